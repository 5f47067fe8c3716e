"""All-gather context parallelism: every rank gathers the keys and values of the whole sequence and
attends its own queries to them (Megatron-Core's all-gather KV variant; Llama 3's context parallelism,
Grattafiori et al. 2024, §3.3.2). Simpler than the ring and without overlap: one all-gather of K/V
forward, one reduce-scatter of their gradients backward (the gradient of a value every rank used is
the sum of the ranks' partial gradients). The blocks a rank needs under the causal mask and their merge
are the ring's (:func:`.blocks.block_pair`, :class:`.partial.PartialAttention`), here under autograd; so is
the dropout of each block's probabilities, its mask drawn for the block's global positions.
"""

from __future__ import annotations

import torch

from shardwise.dist.functional import _GatherReduceScatter
from shardwise.parallel.context.blocks import block_forward, block_pair
from shardwise.parallel.context.partial import PartialAttention
from shardwise.parallel.context.ring import block_keep


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, drop=None) -> torch.Tensor:
    """Attention (causal, or not for an encoder) of this rank's queries ``[B, H, t, d]`` over the whole
    sequence's keys/values; ``drop``: the probabilities' dropout (None: none)."""
    n, r, t = core.size, core.rank, q.shape[2]
    kv = torch.stack((k, v))  # [2, B, Hkv, t, d]: one gather for both
    every = _GatherReduceScatter.apply(kv.unsqueeze(0), 0, core.group, core.stats)  # [n, 2, B, Hkv, t, d]
    scale = q.shape[-1] ** -0.5
    acc = PartialAttention(t, core.layout.balance == "headtail" and core.causal)
    for src in [r, *(j for j in range(n) if j != r)]:  # the diagonal first: it covers every row
        pair = block_pair(r, src, t, core.layout.balance, core.causal)
        if pair is None:
            continue
        keep = None if drop is None else block_keep(core, drop, q.shape[0], t, src, pair, q.device)
        with core.timed(q):
            out_b, lse_b = block_forward(q[:, :, pair.q], every[src, 0][:, :, pair.kv],
                                         every[src, 1][:, :, pair.kv], scale, pair.causal, keep,
                                         0.0 if drop is None else drop.p)
            acc.add(pair.q, out_b, lse_b)
        core.count_work(pair, t)
    return acc.result()[0].to(q.dtype)
