"""``train.compile``: each block's forward is compiled from outside the model (parallel/compile.py).

Only the wiring is checked here (compiling on this 2-core CPU takes tens of seconds); the compiled
speed is measured by ``bench/bench_mfu.py --compile on`` on a GPU."""

from __future__ import annotations

import torch

from shardwise.config import Config
from shardwise.model import Transformer
from shardwise.parallel.compile import apply_compile


def test_every_block_forward_is_compiled_and_the_state_dict_is_unchanged():
    cfg = Config.load(overrides={"model.preset": "tiny", "train.compile": "true"}).resolve(world_size=1,
                                                                                          tokenizer_vocab=256)
    assert cfg.train.compile is True
    model = Transformer(cfg.model)
    keys = list(model.state_dict())
    assert apply_compile(model) == [0, 1]
    assert list(model.state_dict()) == keys
    for block in model.blocks:
        assert hasattr(block.forward, "_torchdynamo_orig_callable"), "not a torch.compile wrapper"
    assert isinstance(model, torch.nn.Module)
