"""Cross-entropy over a vocabulary split across tensor-parallel ranks, without gathering the logits.

Shoeybi et al. 2019, "Megatron-LM", §3: "we fuse the output GEMM with the cross entropy loss which
reduces the dimension to b × s" -- each rank holds the logits of a contiguous range of the
vocabulary, ``[N, V/tp]``, and the loss of token ``i`` with target ``t``,

    loss_i = log sum_v exp(z_iv) - z_it = log sum_v exp(z_iv - m_i) - (z_it - m_i),

needs only three numbers per token from the other ranks: the maximum ``m_i`` (all-reduce MAX, for a
stable exponent), the shifted target logit ``z_it - m_i`` (all-reduce SUM; only the rank holding
``t`` contributes) and the sum of exponentials (all-reduce SUM). The gradient is local:
``d loss_i / d z_iv = softmax(z_i)_v - [v == t]`` on each rank's own columns, no communication.

Columns at or past ``vocab_size`` (padding that makes the vocabulary divide by tp) are excluded:
their logits count as -inf. Tokens whose target is ``ignore_index`` (-100) contribute neither loss
nor gradient. :func:`vocab_parallel_cross_entropy` returns ``(sum, count)`` so that the caller
reduces over whatever group its tokens are spread on (dp × cp) and divides once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.dist.comm.counting import CommStats, nbytes

IGNORE_INDEX = -100


def _all_reduce(t: torch.Tensor, op, group, stats: CommStats | None) -> None:
    if stats is None:
        dist.all_reduce(t, op=op, group=group)
        return
    stats.hand(nbytes(t), backend=True)
    with stats.waiting():  # blocking: all of it is exposed
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token losses ``[N]`` (0 for ignored tokens) from local logits ``[N, V_local]``."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, stats):
        n_local = logits.shape[-1]
        z = logits.float()
        real = vocab_size - vocab_start  # columns of this rank that are in the vocabulary
        if real < n_local:
            z = z.clone()
            z[:, max(real, 0):] = float("-inf")
        # 1. the maximum over the whole vocabulary
        m = z.max(dim=-1).values
        _all_reduce(m, dist.ReduceOp.MAX, group, stats)
        z = z - m.unsqueeze(-1)  # a new tensor: the logits are untouched
        # 2. the target's shifted logit, from the rank that holds it
        local_t = targets - vocab_start
        here = (local_t >= 0) & (local_t < min(n_local, max(real, 0)))
        idx = torch.where(here, local_t, torch.zeros_like(local_t))
        zt = torch.where(here, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
        _all_reduce(zt, dist.ReduceOp.SUM, group, stats)
        # 3. the sum of exponentials
        z.exp_()
        s = z.sum(dim=-1)
        _all_reduce(s, dist.ReduceOp.SUM, group, stats)
        valid = targets != IGNORE_INDEX
        loss = torch.where(valid, s.log() - zt, 0.0)
        z.div_(s.unsqueeze(-1))  # z now holds this rank's columns of the softmax
        ctx.save_for_backward(z, idx, here, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, here, valid = ctx.saved_tensors
        g = softmax  # the saved buffer is reused: this graph cannot be backpropagated twice
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, idx] -= here.to(g.dtype)
        g.mul_(torch.where(valid, grad, 0.0).unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of the token cross-entropies of logits split over ``group`` along the vocabulary.

    ``logits [..., V_local]`` are this rank's columns ``vocab_start .. vocab_start + V_local`` of the
    full logits (any leading shape; computed in fp32); ``targets [...]`` the full vocabulary's ids
    (``-100``: ignored); ``vocab_size`` the real vocabulary (columns at or past it are padding and
    excluded). Returns ``(sum, count)``: the fp32 sum of the losses of the non-ignored tokens (with
    gradient) and their number (int64, no gradient). Communication, recorded in ``stats``: three
    all-reduces of ``N`` fp32 values (N = tokens) forward, none backward.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_logits.shape[0] != flat_targets.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} hold different token counts")
    losses = _VocabParallelCE.apply(flat_logits, flat_targets, vocab_start, vocab_size, group, stats)
    return losses.sum(), (flat_targets != IGNORE_INDEX).sum()


class VocabParallelLoss:
    """The model's loss function (``Transformer.loss_fn``) for a vocabulary-parallel head: the fp32 mean
    cross-entropy over non-ignored tokens, ``sum / count`` of :func:`vocab_parallel_cross_entropy`.
    Every rank of ``group`` holds the same tokens, so the count needs no communication."""

    def __init__(self, *, vocab_start: int, vocab_size: int, group, stats: CommStats | None = None):
        self.vocab_start, self.vocab_size, self.group, self.stats = vocab_start, vocab_size, group, stats

    def sum_and_count(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_cross_entropy(
            logits, targets, vocab_start=self.vocab_start, vocab_size=self.vocab_size, group=self.group,
            stats=self.stats,
        )

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total, count = self.sum_and_count(logits, targets)
        return total / count

    def __repr__(self) -> str:
        return f"VocabParallelLoss(vocab_start={self.vocab_start}, vocab_size={self.vocab_size})"


__all__ = ["IGNORE_INDEX", "VocabParallelLoss", "vocab_parallel_cross_entropy"]
