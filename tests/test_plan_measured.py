"""Predicted beside measured on CPU: activation bytes (the tensors autograd saves for backward)
and model-state bytes of the layouts the trainer runs today (data parallel, fp32 states)."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import Config
from shardwise.model.transformer import Transformer
from shardwise.plan.memory import STATE_CONVENTIONS, activation_mode, memory_breakdown
from shardwise.plan.spec import Layout, model_spec
from shardwise.train.precision import autocast_context


def saved_tensor_bytes(model: Transformer, tokens: torch.Tensor, precision: str) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters and buffers excluded."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context(precision, "cpu"):
        loss = model(tokens, tokens)
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("preset", ["cpu-demo", "tiny-llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_bytes_within_10_percent(preset, precision):
    cfg = Config.load(overrides={"model.preset": preset}).resolve(world_size=1, tokenizer_vocab=257)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    b, s = 2, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s))
    measured = saved_tensor_bytes(model, tokens, precision)
    states = STATE_CONVENTIONS["shardwise"]
    mem = memory_breakdown(model_spec(cfg), Layout(micro_batch=b), s, states, "flash",
                           activation_mode(precision, states))
    predicted = mem.by_metric()["mem_activations_bytes"]
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


def test_model_state_bytes_equal_the_trainers_tensors():
    """fp32 weights and gradients and AdamW's two fp32 moments: exactly the tensors the trainer holds."""
    cfg = Config.load(overrides={"model.preset": "tiny-llama"}).resolve(world_size=1, tokenizer_vocab=257)
    model = Transformer(cfg.model)
    model(torch.randint(0, 257, (1, 8)), torch.randint(0, 257, (1, 8))).backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    optim = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
                if k in ("exp_avg", "exp_avg_sq"))
    mem = memory_breakdown(model_spec(cfg), Layout(), 64, STATE_CONVENTIONS["shardwise"]).by_metric()
    assert (mem["mem_params_bytes"], mem["mem_grads_bytes"], mem["mem_optimizer_bytes"]) == (weights, grads, optim)
