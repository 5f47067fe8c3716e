"""``train.compile``: each block's forward is compiled from outside the model (parallel/compile.py).

Only the wiring is checked here, with ``torch.compile`` recorded rather than run (importing and running
the compiler costs tens of seconds on this 2-core CPU); the compiled speed is measured by
``bench/bench_mfu.py`` (compile on / off) on a GPU."""

from __future__ import annotations

import torch

from shardwise.config import Config
from shardwise.config_resolve import resolve
from shardwise.model import Transformer
from shardwise.parallel import compile as compile_module


def test_every_block_forward_is_compiled_and_the_state_dict_is_unchanged(monkeypatch):
    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(compile_module.torch, "compile", fake_compile)
    cfg = resolve(Config.load(overrides={"model.preset": "tiny", "train.compile": "true"}), world_size=1,
                                                                                          tokenizer_vocab=256)
    assert cfg.train.compile is True
    model = Transformer(cfg.model)
    keys = list(model.state_dict())
    forwards = [block.forward for block in model.blocks]
    assert compile_module.apply_compile(model) == [0, 1]
    assert compiled == forwards  # each block's own forward (after recompute's wrapper, if any)
    assert list(model.state_dict()) == keys
    x = torch.randint(0, 256, (1, 8))
    assert model(x, x).isfinite()
