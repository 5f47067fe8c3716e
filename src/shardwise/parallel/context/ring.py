"""Ring attention: key/value blocks travel around the context-parallel ring while each rank attends its
queries to the block it holds (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers
for Near-Infinite Context", §3 and Algorithm 1; the causal, load-balanced form of torchtitan's and
picotron's context parallelism).

Forward, on ``cp`` ranks: at step ``s`` rank ``r`` holds the keys/values of rank ``(r - s) mod cp``; it
starts sending them to rank ``r + 1`` and receiving the next block from ``r - 1`` (one batched
``isend``/``irecv``), computes its causal block pair (:func:`.blocks.block_pair`) meanwhile, merges the
result by log-sum-exp (:mod:`.blocks`) and waits for the transfer. Only ``(out, lse)`` are kept.

Backward rotates keys/values again and recomputes each block's scores from the saved ``lse``
(FlashAttention's backward, Dao et al. 2022 §3.1). Each block runs torch's fused flash-attention
kernel where it exposes the log-sum-exp (CPU; :func:`.blocks.attend`), else the eager reference.
The gradient of a key/value block travels with it: the accumulator of block ``(r - s)`` arrives
from rank ``r - 1``, gains rank ``r``'s contribution and is sent on; after ``cp`` steps each block's
dK/dV, summed over every rank that attended to it, arrives at its owner. Transfers are overlapped
with the next block's computation; key/value and gradient messages carry distinct tags, so with
``cp = 2`` (where the next and previous rank coincide) they never cross.

With dropout on the probabilities each block draws its mask for its global query and key positions and
heads (:class:`~shardwise.model.dropout.AttentionDropout`) and runs the eager block (:func:`.blocks.block_forward`,
which applies it); backward draws the same mask again (the generator is counter-based: nothing is kept).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.model.dropout import aligned_index
from shardwise.parallel.context.blocks import attend, attend_backward, block_backward, block_forward, block_pair
from shardwise.parallel.context.partial import PartialAttention

KV_TAG, GRAD_TAG = 71, 72


class _Transfer:
    """Send ``t`` to the next rank of the ring and receive the previous rank's tensor of the same shape."""

    def __init__(self, core, t: torch.Tensor, tag: int):
        self.sent, self.buf = t, torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, core.next_rank, core.group, tag),
               dist.P2POp(dist.irecv, self.buf, core.prev_rank, core.group, tag)]
        core.count_send(t)
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for req in self.requests:
            req.wait()
        return self.buf


def block_keep(core, drop, batch: int, t: int, src: int, pair, device=None) -> torch.Tensor:
    """The dropout mask of the block ``pair`` of this rank's ``t`` queries (of ``batch`` sequences) against rank
    ``src``'s keys: drawn for their global positions (the all-gather core draws the same blocks)."""
    queries = core.layout.positions(t, device=device)[pair.q]
    keys = core.layout.positions(t, rank=src, device=device)[pair.kv]
    aligned = aligned_index(core.layout.positions(t, rank=src)[pair.kv], t * core.size)  # on the host: no wait
    return drop.keep(batch, queries, keys, t * core.size, causal=core.causal, keys_aligned=aligned)


class RingAttentionFunction(torch.autograd.Function):
    """``out = attention(q, k, v)`` over the whole sequence (causal, or not for an encoder), with ``q, k, v``
    this rank's tokens; ``drop``: the probabilities' dropout (None: none)."""

    @staticmethod
    def forward(ctx, q, k, v, core, drop=None, scale=None):
        n, r, t = core.size, core.rank, q.shape[2]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        kv = torch.stack((k, v)).contiguous()
        acc = PartialAttention(t, core.layout.balance == "headtail" and core.causal)
        for step in range(n):
            src = (r - step) % n
            transfer = _Transfer(core, kv, KV_TAG) if step < n - 1 else None
            pair = block_pair(r, src, t, core.layout.balance, core.causal)
            if pair is not None:
                q_b, k_b, v_b = q[:, :, pair.q], kv[0][:, :, pair.kv], kv[1][:, :, pair.kv]
                with core.timed(q):
                    if drop is None:
                        out_b, lse_b = attend(q_b, k_b, v_b, scale, pair.causal)
                    else:
                        keep = block_keep(core, drop, q.shape[0], t, src, pair, q.device)
                        out_b, lse_b = block_forward(q_b, k_b, v_b, scale, pair.causal, keep, drop.p)
                    acc.add(pair.q, out_b, lse_b)
                core.count_work(pair, t)
            if transfer is not None:
                kv = transfer.wait()
        out, lse = acc.result()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.core, ctx.drop, ctx.scale = core, drop, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        core, drop, scale = ctx.core, ctx.drop, ctx.scale
        n, r, t = core.size, core.rank, q.shape[2]
        dout = grad.contiguous()
        delta = None if drop is None else (dout.float() * out.float()).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack((k, v)).contiguous()
        grads_in = None
        for step in range(n):
            src = (r - step) % n
            transfer = _Transfer(core, kv, KV_TAG) if step < n - 1 else None
            dkv = torch.zeros_like(kv, dtype=torch.float32)
            pair = block_pair(r, src, t, core.layout.balance, core.causal)
            if pair is not None:
                rows, cols = pair.q, pair.kv
                k_b, v_b = kv[0][:, :, cols], kv[1][:, :, cols]
                if drop is None:
                    dq_b, dk_b, dv_b = attend_backward(q[:, :, rows], k_b, v_b, dout[:, :, rows], out[:, :, rows],
                                                       lse[:, :, rows], scale, pair.causal)
                else:  # the same mask again, drawn from the same counters
                    keep = block_keep(core, drop, q.shape[0], t, src, pair, q.device)
                    dq_b, dk_b, dv_b = block_backward(q[:, :, rows], k_b, v_b, dout[:, :, rows], lse[:, :, rows],
                                                      delta[:, :, rows], scale, pair.causal, keep, drop.p)
                dq[:, :, rows] += dq_b
                dkv[0][:, :, cols] += dk_b
                dkv[1][:, :, cols] += dv_b
            if grads_in is not None:  # what the ranks before this one added to block src's gradient
                dkv += grads_in.wait()
            grads_in = _Transfer(core, dkv, GRAD_TAG)
            if transfer is not None:
                kv = transfer.wait()
        dkv = grads_in.wait()  # this rank's own block, summed over every rank that attended to it
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None
