"""Attention over one block of keys at a time, and the merge of partial results by log-sum-exp.

Blockwise attention (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al.
2022, "FlashAttention", §3.1; Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3): the
softmax attention of queries over all keys equals a merge of the attention over disjoint blocks of keys,
each block returning its output ``o_b`` and the log-sum-exp ``lse_b`` of its scores. Merging two partial
results (the numerically stable form used by torchtitan / picotron):

    o   <- o - sigmoid(lse_b - lse) * (o - o_b)
    lse <- lse - logsigmoid(lse - lse_b)

which is ``o = (e^lse o + e^lse_b o_b) / (e^lse + e^lse_b)`` and ``lse = log(e^lse + e^lse_b)``.

The backward of a block needs only the merged output's ``lse`` and ``delta = rowsum(dO * O)``
(FlashAttention §3.1, Algorithm 2 / appendix B.2): ``P = exp(S - lse)``, ``dV = P^T dO``,
``dS = P * (dO V^T - delta)``, ``dQ = dS K * scale``, ``dK = dS^T Q * scale``.

Grouped-query attention (Ainslie et al. 2023): ``q [B, H, T, d]`` and ``k, v [B, Hkv, S, d]``; query head
``h`` uses key/value head ``h // (H / Hkv)``, computed by viewing ``q`` as ``[B, Hkv, H/Hkv, T, d]``.

Which blocks a rank computes under a causal mask, for the layouts of :mod:`.layout`
(:func:`block_pair`): its own block is causal (its positions increase); with head-tail balance a block
from an earlier rank is seen whole by all queries against its first (early) chunk, a block from a later
rank by the second (late) half of the queries only; with a contiguous split an earlier rank's block is
seen whole and a later one not at all. Without a causal mask (an encoder: bert) every block is seen whole.

Dropout on the attention probabilities (FlashAttention's blockwise form, Dao et al. 2022, Algorithm 4 and
appendix B.4): a block's output sums the *dropped* probabilities ``Z = P o M / (1 - p)`` times its values,
while its ``lse`` is that of the undropped scores (the softmax normalises before dropout), so the merge is
unchanged. Backward: ``dV = Z^T dO``, ``dP = (dO V^T) o M / (1 - p)``, ``dS = P o (dP - delta)`` with the same
``delta = rowsum(dO o O)``. ``keep`` is the block's mask, drawn for its global positions
(:class:`~shardwise.model.dropout.AttentionDropout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwise.model.dropout import apply_keep


@dataclass(frozen=True)
class BlockPair:
    """What queries of one rank compute against the keys of another: ``q`` rows and ``kv`` columns as
    slices of the local sequences, and whether the (square) block needs the causal triangle."""

    q: slice
    kv: slice
    causal: bool

    def work(self, q_len: int, kv_len: int) -> float:
        """Score entries this block needs (a causal block counts half), as a fraction of ``q_len * kv_len``."""
        rows = len(range(*self.q.indices(q_len)))
        cols = len(range(*self.kv.indices(kv_len)))
        return rows * cols * (0.5 if self.causal else 1.0)


def block_pair(q_rank: int, kv_rank: int, local_len: int, balance: str, causal: bool = True) -> BlockPair | None:
    """The block queries of ``q_rank`` compute against keys of ``kv_rank`` (None: fully masked)."""
    everything = slice(0, local_len)
    if not causal:
        return BlockPair(everything, everything, False)
    if q_rank == kv_rank:
        return BlockPair(everything, everything, True)
    if balance == "headtail":
        half = local_len // 2
        if kv_rank < q_rank:  # every query is later than the early chunk of kv_rank, earlier than its late one
            return BlockPair(everything, slice(0, half), False)
        return BlockPair(slice(half, local_len), everything, False)  # only the late chunk of q sees kv_rank
    return BlockPair(everything, everything, False) if kv_rank < q_rank else None


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, t, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, t, d)


def _scores(qg: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.einsum("bkgtd,bksd->bkgts", qg.float(), k.float()) * scale
    if causal:
        t, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(t, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  keep: torch.Tensor | None = None, p_drop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, H, T, d]`` over one block ``k, v [B, Hkv, S, d]``: ``(out [B, H, T, d] fp32,
    lse [B, H, T] fp32)``. ``causal``: the block is square and on the diagonal (top-left aligned). ``keep``
    ``[B, H, T, S]``: the dropout mask of the block's probabilities (probability ``p_drop``)."""
    kvh = k.shape[1]
    qg = _grouped(q, kvh)
    s = _scores(qg, k, scale, causal)
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if keep is not None:
        p = apply_keep(p, _grouped(keep, kvh), p_drop)
    out = torch.einsum("bkgts,bksd->bkgtd", p, v.float())
    return out.flatten(1, 2), lse.flatten(1, 2)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's ``(out_b, lse_b)`` into the running ``(out, lse)`` (None: nothing yet)."""
    if out is None:
        return out_b, lse_b
    out = out - torch.sigmoid(lse_b - lse).unsqueeze(-1) * (out - out_b)
    lse = lse - F.logsigmoid(lse - lse_b)
    return out, lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, scale: float, causal: bool, keep: torch.Tensor | None = None,
                   p_drop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (fp32) of one block, from the merged ``lse`` and ``delta = rowsum(dout * out)``
    (``keep``, ``p_drop``: the block's dropout, as :func:`block_forward` applied it)."""
    kvh = k.shape[1]
    qg, dog = _grouped(q, kvh).float(), _grouped(dout, kvh).float()
    s = _scores(qg, k, scale, causal)
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), kvh))
    mask = None if keep is None else _grouped(keep, kvh)
    dv = torch.einsum("bkgts,bkgtd->bksd", p if mask is None else apply_keep(p, mask, p_drop), dog)
    dp = torch.einsum("bkgtd,bksd->bkgts", dog, v.float())
    if mask is not None:
        dp = apply_keep(dp, mask, p_drop)
    ds = p * (dp - _grouped(delta.unsqueeze(-1), kvh))
    dq = torch.einsum("bkgts,bksd->bkgtd", ds, k.float()) * scale
    dk = torch.einsum("bkgts,bkgtd->bksd", ds, qg) * scale
    return dq.flatten(1, 2), dk, dv


# ---- the fused kernel where there is one --------------------------------------------------------------


def _fused(q: torch.Tensor) -> bool:
    """The CPU flash-attention kernel returns the log-sum-exp and takes it back in its backward: the ring
    uses it on CPU (an eager einsum elsewhere: the CUDA kernels' signatures differ; not wired yet)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    rep = q.shape[1] // k.shape[1]
    return (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), rep) if rep > 1 else (k, v, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_forward` by the fused kernel where available (outside autograd: the kernel's lse output
    has no gradient, so callers that merge under autograd use :func:`block_forward`)."""
    if not _fused(q):
        return block_forward(q, k, v, scale, causal)
    ke, ve, _ = _expanded(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, ke.to(q.dtype), ve.to(q.dtype), 0.0,
                                                                          causal, scale=scale)
    return out.float(), lse.float()


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` from the merged ``out`` and ``lse``, by the fused kernel where available."""
    if not _fused(q):
        return block_backward(q, k, v, dout, lse, (dout.float() * out.float()).sum(-1), scale, causal)
    ke, ve, rep = _expanded(q, k, v)
    dt = q.dtype
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(dt), q, ke.to(dt), ve.to(dt), out.to(dt), lse.float(), 0.0, causal, scale=scale)
    if rep > 1:
        b, _, s, d = dk.shape
        dk, dv = dk.view(b, -1, rep, s, d).sum(2), dv.view(b, -1, rep, s, d).sum(2)
    return dq.float(), dk.float(), dv.float()
