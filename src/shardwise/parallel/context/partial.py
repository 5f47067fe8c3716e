"""A running merge of blockwise attention results over the rows of a rank's queries.

Blocks may cover all of a rank's queries or only its second half (the late chunk under head-tail
balance, :func:`.blocks.block_pair`), so the running ``(out, lse)`` is kept per row segment and merged
without in-place writes: the same accumulator serves inside an autograd Function (ring attention) and
under autograd (all-gather attention)."""

from __future__ import annotations

import torch

from shardwise.parallel.context.blocks import merge


class PartialAttention:
    """``(out, lse)`` of queries ``[B, H, t, d]`` accumulated block by block (see :func:`.blocks.merge`)."""

    def __init__(self, t: int, halves: bool):
        self.cuts = [0, t // 2, t] if halves else [0, t]
        self.out: list[torch.Tensor | None] = [None] * (len(self.cuts) - 1)
        self.lse: list[torch.Tensor | None] = [None] * (len(self.cuts) - 1)

    def add(self, rows: slice, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        """Merge a block computed for query rows ``rows`` (a union of whole segments)."""
        for i, (a, b) in enumerate(zip(self.cuts, self.cuts[1:], strict=False)):
            if a >= rows.start and b <= rows.stop:
                o, lse = out_b[:, :, a - rows.start:b - rows.start], lse_b[:, :, a - rows.start:b - rows.start]
                self.out[i], self.lse[i] = merge(self.out[i], self.lse[i], o, lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if any(o is None for o in self.out):
            raise RuntimeError("blockwise attention: some query rows saw no key (the first block must be the diagonal)")
        return torch.cat(self.out, dim=2), torch.cat(self.lse, dim=2)
