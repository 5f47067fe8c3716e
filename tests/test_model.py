"""Unit tests for the single-device model: shapes, causality, initialisation, GQA, RoPE, counts, sampling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import Config
from shardwise.config_resolve import resolve
from shardwise.model import Transformer
from shardwise.model.generate import generate

VOCAB = 257


def model_cfg(preset: str = "tiny", **fields):
    overrides = {"model.preset": preset, **{f"model.{k}": v for k, v in fields.items()}}
    return resolve(Config.load(overrides=overrides), tokenizer_vocab=VOCAB).model


def tokens(b: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


FLAVOURS = ["tiny", "tiny-llama"]


@pytest.mark.parametrize("preset", FLAVOURS)
def test_shapes_and_initial_loss(preset):
    model = Transformer(model_cfg(preset))
    x, y = tokens(), tokens(seed=1)
    logits = model(x)
    assert logits.shape == (2, 16, VOCAB)
    loss = model(x, y)
    assert loss.shape == () and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(VOCAB)) < 0.15
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    block = model.blocks[0]
    h = torch.randn(2, 16, model.cfg.d_model)
    assert block(h).shape == h.shape


@pytest.mark.parametrize("preset", FLAVOURS)
def test_causal(preset):
    model = Transformer(model_cfg(preset))
    x = tokens(1, 20)
    x2 = x.clone()
    x2[0, 12] = (x[0, 12] + 1) % VOCAB
    a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("preset", FLAVOURS)
def test_init_deterministic_by_seed(preset):
    cfg = model_cfg(preset)
    rng = torch.get_rng_state()
    a, b, c = Transformer(cfg), Transformer(cfg), Transformer(cfg)
    a.reset_parameters(7)
    b.reset_parameters(7)
    c.reset_parameters(8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], atol=0, rtol=0)
    assert not torch.equal(sa["blocks.0.attn.q_proj.weight"], sc["blocks.0.attn.q_proj.weight"])
    assert not torch.equal(sa["blocks.0.attn.q_proj.weight"], sa["blocks.1.attn.q_proj.weight"])
    # neither construction nor reset_parameters uses the global RNG
    torch.set_rng_state(rng)
    Transformer(cfg).reset_parameters(3)
    assert torch.equal(torch.get_rng_state(), rng)


def test_init_scheme():
    cfg = model_cfg("tiny", n_layers=4)
    model = Transformer(cfg)
    blk = model.blocks[0]
    assert torch.all(blk.attn.q_proj.bias == 0) and torch.all(blk.norm1.weight == 1) and torch.all(blk.norm1.bias == 0)
    std = blk.mlp.fc_in.weight.std().item()
    assert abs(std - cfg.init_std) < 0.002
    std_out = blk.mlp.fc_out.weight.std().item()
    assert abs(std_out - cfg.init_std / math.sqrt(2 * cfg.n_layers)) < 0.001


@pytest.mark.parametrize("preset", FLAVOURS)
def test_init_independent_of_n_layers(preset):
    small, large = Transformer(model_cfg(preset, n_layers=2)), Transformer(model_cfg(preset, n_layers=4))
    s, g = small.state_dict(), large.state_dict()
    for name, value in s.items():
        if name.split(".")[-2] in ("o_proj", "fc_out", "down_proj") and name.endswith("weight"):
            # the same draws; only the 1/sqrt(2 * n_layers) residual scale differs
            torch.testing.assert_close(value, g[name] * math.sqrt(2 * 4) / math.sqrt(2 * 2))
        else:
            torch.testing.assert_close(value, g[name], atol=0, rtol=0)


def test_init_survives_partitioning_and_wrapping():
    full = Transformer(model_cfg("tiny-llama", n_layers=4))
    full.reset_parameters(5)
    part = Transformer(model_cfg("tiny-llama", n_layers=4))
    part.blocks = torch.nn.ModuleList(list(part.blocks)[2:])  # a later pipeline stage's blocks

    class Wrapper(torch.nn.Module):  # stands in for activation-checkpoint wrappers
        def __init__(self, inner):
            super().__init__()
            self._wrapped_module = inner

        def forward(self, x):
            return self._wrapped_module(x)

    part.blocks[1] = Wrapper(part.blocks[1])
    part.reset_parameters(5)
    torch.testing.assert_close(part.blocks[0].state_dict(), full.blocks[2].state_dict(), atol=0, rtol=0)
    torch.testing.assert_close(part.blocks[1]._wrapped_module.state_dict(), full.blocks[3].state_dict(), atol=0, rtol=0)


@pytest.mark.parametrize("preset", FLAVOURS)
def test_meta_construction_then_materialise(preset):
    cfg = model_cfg(preset)
    ref = Transformer(cfg)
    ref.reset_parameters(11)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.tok_emb.weight.is_meta
    model.to_empty(device="cpu")
    model.reset_parameters(11)
    assert (model.lm_head.weight is model.tok_emb.weight) == cfg.tie_embeddings  # re-tied after to_empty
    assert model.num_parameters() == ref.num_parameters()
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), atol=0, rtol=0)
    x = tokens()
    torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)


def test_tied_embeddings():
    gpt2 = Transformer(model_cfg("tiny"))
    assert gpt2.lm_head.weight is gpt2.tok_emb.weight
    assert gpt2.lm_head.weight.data_ptr() == gpt2.tok_emb.weight.data_ptr()
    llama = Transformer(model_cfg("tiny-llama"))
    assert llama.lm_head.weight.data_ptr() != llama.tok_emb.weight.data_ptr()
    assert not torch.equal(llama.lm_head.weight, llama.tok_emb.weight)
    assert not any("rope" in k for k in llama.state_dict())  # rotary tables are not persistent


def test_rotary_tables_stay_fp32():
    model = Transformer(model_cfg("tiny-llama"))
    cos = model.rope.cos.clone()
    model.to(torch.bfloat16)
    assert model.rope.cos.dtype == torch.float32 and torch.equal(model.rope.cos, cos)
    assert model.blocks[1].attn.rope is model.rope  # one table shared by all layers
    assert model(tokens()).dtype == torch.bfloat16


def test_gqa_matches_repeated_kv_reference():
    cfg = model_cfg("tiny-llama", n_heads=4, n_kv_heads=2)
    model = Transformer(cfg)
    attn = model.blocks[0].attn
    b, t, hd = 2, 10, cfg.d_model // cfg.n_heads
    x = torch.randn(b, t, cfg.d_model, generator=torch.Generator().manual_seed(0))
    q = attn.q_proj(x).view(b, t, cfg.n_heads, hd).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
    q, k = model.rope(q, k)
    groups = cfg.n_heads // cfg.n_kv_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, cfg.d_model)
    torch.testing.assert_close(attn(x), attn.o_proj(y), atol=1e-5, rtol=1e-5)


def test_rotary_scores_depend_on_relative_position_only():
    model = Transformer(model_cfg("tiny-llama"))
    hd, t = model.rope.head_dim, 24
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, hd, generator=gen).expand(1, 1, t, hd)
    k = torch.randn(1, 1, 1, hd, generator=gen).expand(1, 1, t, hd)
    rq, rk = model.rope(q, k)
    scores = (rq @ rk.transpose(-1, -2))[0, 0]  # scores[m, n] = <R(m) q, R(n) k>
    for m, n, c in [(3, 1, 5), (10, 10, 7), (2, 9, 13), (0, 0, 23)]:
        torch.testing.assert_close(scores[m, n], scores[m + c, n + c], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores[3, 1], scores[3, 2])
    # rotation preserves norms
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))


def test_num_parameters_formula():
    cfg = model_cfg("tiny")
    L, d, V, S = cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.max_seq_len
    assert cfg.d_ff == 4 * d
    # per block: attention 4d^2 + 4d, MLP 8d^2 + 5d, two LayerNorms 4d; plus tied embedding, positions, norm_f
    per_block = 12 * d * d + 13 * d
    model = Transformer(cfg)
    assert model.num_parameters() == L * per_block + V * d + S * d + 2 * d
    assert model.num_parameters(exclude_embeddings=True) == L * per_block + 2 * d

    cfg = model_cfg("tiny-llama")
    L, d, V, f = cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.d_ff
    kv = cfg.n_kv_heads * (d // cfg.n_heads)
    per_block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    model = Transformer(cfg)
    assert model.num_parameters() == L * per_block + 2 * V * d + d
    assert model.num_parameters(exclude_embeddings=True) == L * per_block + V * d + d


def test_gpt2_124m_parameter_count_on_meta():
    cfg = resolve(Config.load(overrides={"model.preset": "gpt2-124m"})).model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_parameters() == 124_439_808
    assert model(torch.zeros(1, 8, dtype=torch.long, device="meta")).shape == (1, 8, 50257)


@pytest.mark.parametrize("preset", FLAVOURS)
def test_bf16_autocast(preset):
    model = Transformer(model_cfg(preset))
    x, y = tokens(), tokens(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        loss = model(x, y)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    loss.backward()
    assert model.tok_emb.weight.grad is not None and model.tok_emb.weight.grad.dtype == torch.float32
    assert abs(loss.item() - model(x, y).item()) < 0.05


def test_dropout_only_in_training():
    model = Transformer(model_cfg("tiny", dropout=0.2))
    x = tokens()
    model.eval()
    torch.testing.assert_close(model(x), model(x), atol=0, rtol=0)
    model.train()
    torch.manual_seed(0)
    a = model(x)
    assert not torch.equal(a, model(x))


def test_sequence_longer_than_max_seq_len_raises():
    model = Transformer(model_cfg("tiny"))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(1, model.cfg.max_seq_len + 1))


@pytest.mark.parametrize("preset", FLAVOURS)
def test_generate(preset):
    model = Transformer(model_cfg(preset))
    model.train()
    prompt = [1, 2, 3]
    out = generate(model, prompt, max_new_tokens=5, seed=0)
    assert len(out) == 5 and all(0 <= t < VOCAB for t in out)
    assert model.training  # mode restored
    assert generate(model, torch.tensor(prompt), 5, seed=0) == out
    assert generate(model, prompt, 5, seed=1, temperature=2.0, top_k=None) != generate(
        model, prompt, 5, seed=2, temperature=2.0, top_k=None
    )
    greedy = generate(model, prompt, 4, temperature=0.0)
    assert greedy == generate(model, prompt, 4, temperature=0.0, seed=123)
    # greedy agrees with argmax of the model's own logits
    model.eval()
    assert greedy[0] == int(model(torch.tensor([prompt]))[0, -1].argmax())
    # prompts longer than max_seq_len are cropped
    long_prompt = list(range(model.cfg.max_seq_len + 10))
    assert len(generate(model, long_prompt, 2, top_k=1)) == 2
    assert generate(model, prompt, 0) == []
