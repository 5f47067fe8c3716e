"""Hugging Face interoperability: export a run as a ``transformers`` directory, start a run from one.

* :mod:`shardwise.hf.config_map` -- our ``ModelConfig`` <-> ``config.json`` (pure Python, no torch).
* :mod:`shardwise.hf.weights` -- our single-process state dict <-> the ``transformers`` tensor names.
* :mod:`shardwise.hf.export` -- ``shardwise export RUN_DIR --format hf OUT_DIR`` (atomic).
* :mod:`shardwise.hf.load` -- ``model.init_from = "hf:PATH"``: the single-process state the trainer loads.

``transformers`` itself is never imported here: the directories are plain JSON and safetensors, and
``transformers`` is only needed to use them on the other side (and by the parity tests).
"""
