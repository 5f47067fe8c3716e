"""``model.init_from = "hf:PATH"``: start a run from a transformers directory, on any layout.

The directory is seen as the *single-process* model state (:func:`shardwise.hf.load.lazy_hf_state`, which reads
nothing until asked) and handed to the engine's own layout-free ``load_state`` -- the path a resumed
checkpoint takes -- with an empty optimizer state, so every layout (data parallel, ZeRO 1-3, pipeline, tensor
and expert parallel) takes its part of the weights the way it takes them from a checkpoint, reading only its
slices: a pipeline stage its own tensors, a tensor- or expert-parallel rank its rows (``read_rows``), a ZeRO-3
rank the elements of its shard (``read_slice``). Nothing here knows the layout.
"""

from __future__ import annotations

import torch

from shardwise.hf.config_map import hf_path
from shardwise.hf.load import lazy_hf_state


def init_from_pretrained(engine, cfg) -> str:
    """Load ``cfg.model.init_from`` into ``engine`` (every rank); returns a line for the run's log."""
    from shardwise.model import Transformer
    from shardwise.train.optim import build_optimizer

    path = hf_path(cfg.model.init_from)
    state = lazy_hf_state(path, cfg.model)
    with torch.device("meta"):  # the single-process optimizer's param groups (indices and hyper-parameters)
        groups = build_optimizer(Transformer(cfg.model), cfg.train).state_dict()["param_groups"]
    engine.load_state(state, {"state": {}, "param_groups": groups})
    return f"initialised from {path} ({len(state)} tensors; optimizer state fresh)"
