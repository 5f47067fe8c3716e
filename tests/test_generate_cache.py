"""Generation with the key/value cache gives the same tokens as recomputing the context every step: one
prompt and a left-padded batch, greedy and sampled, GPT-2 and Llama (GQA), past max_seq_len too."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import Config
from shardwise.config_resolve import resolve
from shardwise.model import KVCache, Transformer
from shardwise.model.generate import generate, generate_batch


def model_of(flavor: str) -> Transformer:
    shape = {"model.flavor": flavor, "model.n_layers": "2", "model.d_model": "32", "model.n_heads": "4",
             "model.max_seq_len": "24", "model.preset": "custom", "parallel.nproc": "1"}
    if flavor == "llama":
        shape["model.n_kv_heads"] = "2"
    model = Transformer(resolve(Config.load(overrides=shape), tokenizer_vocab=257).model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: one intra-op thread (several spin on a loaded 2-core machine, 100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [200, 3, 4, 90]]


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
def test_cached_generation_equals_recomputation(flavor):
    model = model_of(flavor)
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 3}):
        # 30 new tokens run past max_seq_len (24): the cache is then re-read every step
        cached = generate_batch(model, PROMPTS, 30, use_cache=True, **kwargs)
        plain = [generate(model, p, 30, use_cache=False, **{**kwargs, "seed": kwargs.get("seed", 0) + r})
                 for r, p in enumerate(PROMPTS)]
        assert cached == plain, kwargs
        assert generate_batch(model, PROMPTS, 30, use_cache=False, **kwargs) == plain


def test_cache_logits_equal_the_full_forward():
    model = model_of("llama").eval()
    tokens = torch.randint(0, 257, (2, 10), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    cache = KVCache(model.cfg.n_layers, 2, model.cfg.max_seq_len)
    steps = [model(tokens[:, :4], cache=cache.feed(torch.ones(2, 4, dtype=torch.bool)))]
    steps += [model(tokens[:, i:i + 1], cache=cache.feed(torch.ones(2, 1, dtype=torch.bool))) for i in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="the cache holds 24 slots; 10 are used and 20 more were fed"):
        cache.feed(torch.ones(2, 20, dtype=torch.bool))
