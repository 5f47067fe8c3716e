"""Autoregressive sampling from a trained :class:`~shardwise.model.Transformer`, one prompt or a batch.

With ``use_cache`` (the default) each step feeds only the new token and attends over a key/value cache
(:mod:`shardwise.model.kv_cache`); without it, each step recomputes the model over the whole (cropped)
context. Both give the same tokens (tested). The context is at most ``model.cfg.max_seq_len`` tokens:
once a sequence is longer, every step re-reads its last ``max_seq_len`` tokens (the positions shift, so
cached keys no longer apply), as the uncached path always does. Prompts of different lengths are
left-padded into one batch.

The next token is drawn from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
tokens (top-k sampling, Fan et al. 2018, "Hierarchical Neural Story Generation", §5.4); temperature 0
is greedy decoding. Sampling runs on the CPU with one ``torch.Generator`` per row (seeded
``seed + row``), so a seed gives the same tokens on any device, batched or not, and the global RNG is
left untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.model.kv_cache import KVCache


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Sample ``max_new_tokens`` tokens after ``prompt_ids`` and return them (without the prompt).

    The model runs in eval mode (no dropout) and is returned to its previous mode afterwards."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().tolist()
    return generate_batch(model, [ids], max_new_tokens, temperature, top_k, seed, use_cache)[0]


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """Sample ``max_new_tokens`` tokens after each prompt; row ``r`` equals ``generate(prompts[r], seed=seed + r)``."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt is empty; give at least one token in every prompt")

    device = next(model.parameters()).device
    max_len, n_layers, batch = model.cfg.max_seq_len, model.cfg.n_layers, len(prompts)
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
    for r, p in enumerate(prompts):
        tokens[r, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        valid[r, width - len(p):] = True
    generators = [torch.Generator() for _ in prompts]
    for r, g in enumerate(generators):
        g.seed() if seed is None else g.manual_seed(seed + r)

    was_training = model.training
    model.eval()
    new: list[list[int]] = [[] for _ in prompts]
    cache = None
    try:
        for _ in range(max_new_tokens):
            if use_cache and cache is not None and cache.length < max_len:
                logits = model(tokens[:, -1:], cache=cache.feed(valid[:, -1:]))
            elif use_cache or not valid[:, -max_len:].all():  # the whole (cropped) context, into a fresh cache
                cache = KVCache(n_layers, batch, max_len, device)
                logits = model(tokens[:, -max_len:], cache=cache.feed(valid[:, -max_len:]))
            else:  # no cache, no padding: the plain causal forward over the (cropped) context
                logits = model(tokens[:, -max_len:])
            last = logits[:, -1].float().cpu()
            step = [_sample(last[r], temperature, top_k, generators[r]) for r in range(batch)]
            for r, t in enumerate(step):
                new[r].append(t)
            tokens = torch.cat([tokens, torch.tensor(step, device=device)[:, None]], 1)
            valid = torch.cat([valid, valid.new_ones(batch, 1)], 1)
    finally:
        model.train(was_training)
    return new


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """One token id from 1-d ``logits``: argmax when ``temperature == 0``, else top-k sampling."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
