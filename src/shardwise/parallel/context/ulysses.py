"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training
of Extreme Long Sequence Transformer Models", §3): an all-to-all turns sequence-sharded ``q, k, v``
(every head, ``t = T / cp`` tokens) into head-sharded ones (``H / cp`` heads, all ``T`` tokens); each
rank runs ordinary causal attention on its heads over the whole sequence, and a second all-to-all turns
the output back. Communication per rank is ``O(T d / cp)`` per all-to-all, independent of the ring's
``cp`` steps; the head count must divide by cp.

Grouped-query attention with fewer key/value heads than ranks: each kv head is replicated ``cp / Hkv``
times before the all-to-all, so rank ``j`` receives the kv head its query heads ``j H/cp ..`` use
(query head ``h`` uses kv head ``h // (H / Hkv)``); the replicas' gradients are summed by the
replication's backward.

The gathered sequence is the ranks' local sequences one after another, which under head-tail balance is
a permutation of the true order: it is put back in order for the causal kernel and permuted back after.
With dropout on the probabilities, the rank draws the mask of its heads over the whole sequence (global head
ids: its tensor-parallel rank's heads, then its share of them) and applies it in an eager core
(:func:`~shardwise.model.scores.attend`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.dist.comm.counting import nbytes
from shardwise.model.dropout import LANES
from shardwise.model.scores import PLAIN, ScoreRule, attend


def _all_to_all(x: torch.Tensor, core) -> torch.Tensor:
    """``x [n, ...]``: piece ``j`` goes to rank ``j``; returns the pieces received, ``[n, ...]`` by source."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if core.stats is not None:
        core.stats.hand(nbytes(x), backend=True)
    dist.all_to_all_single(out, x, group=core.group)
    return out


def _seq_to_heads(x: torch.Tensor, core) -> torch.Tensor:
    """``[B, H, t, d]`` (this rank's tokens) -> ``[B, H/n, n*t, d]`` (this rank's heads, every token)."""
    b, h, t, d = x.shape
    n = core.size
    pieces = x.view(b, n, h // n, t, d).transpose(0, 1)  # [n, B, H/n, t, d]: head group j to rank j
    got = _all_to_all(pieces, core)  # [n(src), B, H/n, t, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def _heads_to_seq(x: torch.Tensor, core) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    b, hn, nt, d = x.shape
    n = core.size
    pieces = x.view(b, hn, n, nt // n, d).permute(2, 0, 1, 3, 4)  # [n, B, H/n, t, d]: tokens of rank j to j
    got = _all_to_all(pieces, core)  # [n(src heads), B, H/n, t, d]
    return got.transpose(0, 1).reshape(b, n * hn, nt // n, d)


class _Reshard(torch.autograd.Function):
    """Sequence-sharded -> head-sharded (``to_heads``) or back; the gradient goes the other way."""

    @staticmethod
    def forward(ctx, x, core, to_heads: bool):
        ctx.core, ctx.to_heads = core, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, core)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.core), None, None


def kv_replicas(n_kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated so that the kv heads split over ``cp`` ranks (1: they do)."""
    if n_kv_heads % cp == 0:
        return 1
    if cp % n_kv_heads == 0:
        return cp // n_kv_heads
    raise ValueError(f"ulysses: {n_kv_heads} key/value heads neither divide by nor divide parallel.cp={cp}")


def ulysses_keep(core, drop, batch: int, heads: int, t: int, device=None) -> torch.Tensor:
    """The dropout mask this rank applies: its share of the ``heads`` query heads it held before the all-to-all
    (group ``rank`` of ``cp``, by global id), over the whole sequence of ``cp * t`` positions in order."""
    per = heads // core.size
    mine = drop.heads.index.to(device)[core.rank * per:(core.rank + 1) * per]
    every = torch.arange(core.size * t, device=device)
    return drop.keep(batch, every, every, core.size * t, heads=mine, causal=core.causal,
                     keys_aligned=core.size * t % LANES == 0)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, drop=None,
                      rule: ScoreRule = PLAIN) -> torch.Tensor:
    """Attention (causal, or not for an encoder) of this rank's tokens ``q [B, H, t, d]``, ``k [B, Hkv, t, d]``,
    ``v [B, Hkv, t, dv]`` by two all-to-alls, under the layer's ``rule`` (scale, sliding window, soft-cap: each
    rank holds whole sequences of its heads, so every rule applies as on one process); ``drop``: the
    probabilities' dropout (None: none)."""
    n, t = core.size, q.shape[2]
    if q.shape[1] % n:
        raise ValueError(f"ulysses: {q.shape[1]} query heads on this rank do not divide by parallel.cp={n}")
    rep = kv_replicas(k.shape[1], n)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh = _Reshard.apply(q, core, True)
    if k.shape == v.shape:
        kh, vh = _Reshard.apply(torch.cat((k, v)), core, True).chunk(2)  # keys and values in one all-to-all
    else:  # values of their own width (multi-head latent attention)
        kh, vh = _Reshard.apply(k, core, True), _Reshard.apply(v, core, True)
    positions = torch.cat([core.layout.positions(t, rank=j, device=q.device) for j in range(n)])
    order = positions.argsort()  # gathered order -> true order
    qh, kh, vh = qh[:, :, order], kh[:, :, order], vh[:, :, order]
    with core.timed(qh):
        if drop is not None:
            keep = ulysses_keep(core, drop, q.shape[0], q.shape[1], t, q.device)
            y = attend(qh, kh, vh, rule, causal=core.causal, keep=keep, p=drop.p)
        elif not rule.plain:
            y = attend(qh, kh, vh, rule, causal=core.causal)
        else:
            y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=core.causal, scale=rule.scale,
                                               enable_gqa=kh.shape[1] != qh.shape[1])
    core.count_whole(n * t, fraction=1 / n)
    return _Reshard.apply(y[:, :, order.argsort()], core, False)
