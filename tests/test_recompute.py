"""Activation recomputation, full and selective: the same gradients, fewer saved bytes (measured)."""

from __future__ import annotations

import copy

import pytest
import torch

from shardwise.config import Config
from shardwise.config_resolve import resolve
from shardwise.model import Transformer
from shardwise.parallel.recompute import apply_recompute
from tests.test_plan_measured import saved_tensor_bytes


def _saved_bytes_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[int, dict]:
    """Bytes autograd keeps for backward (tests/test_plan_measured.py's counter), and the gradients."""
    torch.manual_seed(0)  # dropout masks: the same draws in every variant
    saved = saved_tensor_bytes(model, tokens, "fp32")
    torch.manual_seed(0)
    model(tokens, tokens).backward()
    return saved, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_selective_keeps_less_than_none_and_more_than_full(preset):
    """Korthikanti et al. 2022 §5: recomputing only the attention core drops its activations (with
    dropout the core keeps its mask and probabilities, quadratic in T); full recomputation keeps only
    block inputs. Gradients are equal in all three (dropout masks replayed)."""
    cfg = resolve(Config.load(overrides={"model.preset": preset, "model.dropout": "0.1"}), world_size=1,
                                                                                         tokenizer_vocab=257)
    base = Transformer(cfg.model)
    base.reset_parameters(3)
    tokens = torch.randint(0, 257, (2, cfg.data.seq_len))
    results = {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base)
        touched = apply_recompute(model, mode)
        assert touched == ([] if mode == "none" else list(range(cfg.model.n_layers)))
        results[mode] = _saved_bytes_and_grads(model, tokens)
    none, selective, full = (results[m][0] for m in ("none", "selective", "full"))
    assert full < selective < none, (none, selective, full)
    for mode in ("selective", "full"):
        for name, g in results["none"][1].items():
            torch.testing.assert_close(results[mode][1][name], g, rtol=0, atol=1e-6, msg=(mode, name))


def test_full_every_k_checkpoints_the_same_blocks_in_any_part():
    cfg = resolve(Config.load(overrides={"model.preset": "tiny", "model.n_layers": "5"}), world_size=1,
                                                                                        tokenizer_vocab=257)
    assert apply_recompute(Transformer(cfg.model), "full", every=2) == [0, 2, 4]
    with pytest.raises(ValueError, match="train.recompute='some'"):
        apply_recompute(Transformer(cfg.model), "some")
