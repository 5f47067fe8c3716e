"""Masked language modelling over token windows (BERT's pre-training objective, Devlin et al. 2019 §3.1).

Of each window's tokens, 15 % are chosen as targets (at least one: the token of the smallest draw when none
is, as the data pipeline of BERT's authors chooses ``max(1, round(15 %))``); of those, 80 % are replaced by
``[MASK]``, 10 % by a random token and 10 % left unchanged; the loss is the cross-entropy at the chosen
positions only (the others carry the ignored target -100). The choice for window ``i`` is drawn from a
generator seeded by ``(seed, i)`` alone -- "static masking" (Liu et al. 2019, RoBERTa §4.1) -- so it is the
same on every layout, rank and resume, as the windows of a step are.

``[MASK]`` is bert's special id (the last of the vocabulary, past the tokenizer's; config resolution reserves
it); random replacements are drawn from the tokenizer's ids.
"""

from __future__ import annotations

import zlib

import torch

from shardwise.data.sampler import TokenWindows

MASK_PROB, MASK_TOKEN, RANDOM_TOKEN = 0.15, 0.8, 0.1


def mask_window(tokens: torch.Tensor, seed: int, index: int, mask_id: int, n_random: int,
                prob: float = MASK_PROB) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of one window ``tokens [T]``: the 15 % / 80-10-10 corruption, seeded by
    ``(seed, index)``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"mlm:{seed}:{index}".encode()))
    draw = torch.rand(tokens.shape, generator=g)
    chosen = draw < prob
    if not chosen.any():  # at least one target per window, as BERT's own data has (max(1, round(15 %)) targets):
        chosen[draw.argmin()] = True  # a micro-batch of windows without one had a loss of 0 / 0
    how = torch.rand(tokens.shape, generator=g)
    random_ids = torch.randint(0, n_random, tokens.shape, generator=g)
    inputs = torch.where(chosen & (how < MASK_TOKEN), torch.full_like(tokens, mask_id), tokens)
    inputs = torch.where(chosen & (how >= MASK_TOKEN) & (how < MASK_TOKEN + RANDOM_TOKEN), random_ids, inputs)
    targets = torch.where(chosen, tokens, torch.full_like(tokens, -100))
    return inputs, targets


class MaskedWindows:
    """:class:`TokenWindows` with ``batch(ids)`` returning masked inputs and MLM targets instead of the
    next-token pair (the window itself, not shifted)."""

    def __init__(self, windows: TokenWindows, mask_id: int, seed: int, n_random: int):
        self.windows, self.mask_id, self.seed, self.n_random = windows, mask_id, seed, n_random

    def __len__(self) -> int:
        return len(self.windows)

    def batch(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = self.windows.batch(ids)
        pairs = [mask_window(row, self.seed, int(i), self.mask_id, self.n_random)
                 for row, i in zip(x, ids, strict=True)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
