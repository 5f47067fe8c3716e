"""The planner's arithmetic agrees with the model code and the trainer's config resolution."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.model.transformer import Transformer
from shardwise.plan.flops import flops_per_token, matmul_params
from shardwise.plan.params import count_params
from shardwise.plan.spec import Layout, model_config_of, model_spec
from shardwise.train.flops import GPU_PEAK_FLOPS, training_flops_per_token


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "cpu-demo", "gpt2-124m", "llama-1b"])
def test_param_count_equals_transformer(preset):
    cfg = Config.load(overrides={"model.preset": preset})
    spec = model_spec(cfg)
    with torch.device("meta"):
        model = Transformer(model_config_of(spec))
    counts = count_params(spec)
    assert counts.total == model.num_parameters()
    assert counts.non_embedding == model.num_parameters(exclude_embeddings=True)
    # the planner resolves the model as the trainer does
    trainer = resolve(cfg, world_size=1, tokenizer_vocab=257).model
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len", "tie_embeddings"):
        assert getattr(spec, key) == getattr(trainer, key), key


def test_planner_accepts_layouts_the_trainer_rejects():
    cfg = Config.load(overrides={"model.preset": "gpt3-175b", "parallel.tp": "8", "parallel.pp": "8",
                                 "ps.servers": "1"})
    with pytest.raises(ConfigError):
        resolve(cfg, world_size=64)
    assert model_spec(cfg).n_layers == 96


def test_moe_counts():
    cfg = Config.load(overrides={"model.preset": "tiny-llama"})
    dense = count_params(model_spec(cfg))
    moe = count_params(model_spec(cfg, n_experts=8, moe_top_k=2))
    assert moe.mlp == 8 * dense.mlp and moe.mlp_active == 2 * dense.mlp
    assert moe.router == 2 * 64 * 8
    assert moe.active == dense.total + dense.mlp + moe.router
    assert flops_per_token(model_spec(cfg, 8, 2), 64) > flops_per_token(model_spec(cfg), 64)


@pytest.mark.parametrize("preset", ["cpu-demo", "tiny-llama"])
def test_trainer_flops_come_from_the_planner(preset):
    cfg = resolve(Config.load(overrides={"model.preset": preset}), world_size=1, tokenizer_vocab=257)
    spec = model_spec(cfg)
    fpt = training_flops_per_token(cfg.model, cfg.data.seq_len)
    assert fpt == flops_per_token(spec, cfg.data.seq_len)
    m = cfg.model
    # PaLM App. B: 6 (non-embedding + V d) + 12 L d T, with the head counted once even when untied
    c = count_params(spec)
    assert matmul_params(spec) == c.total - c.embedding - c.position - c.head + m.vocab_size * m.d_model
    assert fpt == 6 * matmul_params(spec) + 12 * m.n_layers * m.d_model * cfg.data.seq_len
    assert GPU_PEAK_FLOPS["A100"]["bf16"] == 312e12


def test_recompute_conventions():
    spec = model_spec(Config.load(overrides={"model.preset": "gpt2-124m"}))
    model = flops_per_token(spec, 1024, "full", "model")
    hw_full = flops_per_token(spec, 1024, "full", "hardware")
    hw_sel = flops_per_token(spec, 1024, "selective", "hardware")
    assert model == flops_per_token(spec, 1024)
    assert model < hw_sel < hw_full < model * 4 / 3 + 1
    assert Layout(dp=2, micro_batch=3, grad_accum=4).global_batch == 24
