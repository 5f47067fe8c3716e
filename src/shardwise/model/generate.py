"""Autoregressive sampling from a trained :class:`~shardwise.model.Transformer`.

Each step recomputes the model over the (cropped) context — no key/value cache — and samples the
next token from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens
(top-k sampling, Fan et al. 2018, "Hierarchical Neural Story Generation", §5.4). Temperature 0 is
greedy decoding. Sampling runs on the CPU with its own ``torch.Generator``, so a seed gives the
same tokens on any device and the global RNG is left untouched.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int | None = None,
) -> list[int]:
    """Sample ``max_new_tokens`` tokens after ``prompt_ids`` and return them (without the prompt).

    The context fed to the model is the last ``model.cfg.max_seq_len`` tokens. The model runs in
    eval mode (no dropout) and is returned to its previous mode afterwards.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().tolist()
    if not ids:
        raise ValueError("prompt_ids is empty; give at least one token")

    device = next(model.parameters()).device
    max_len = model.cfg.max_seq_len
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    was_training = model.training
    model.eval()
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            context = torch.tensor([ids[-max_len:]], dtype=torch.long, device=device)
            logits = model(context)[0, -1].float().cpu()
            next_id = _sample(logits, temperature, top_k, generator)
            ids.append(next_id)
            new.append(next_id)
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
