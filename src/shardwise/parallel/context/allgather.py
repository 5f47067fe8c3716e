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
from shardwise.model.scores import PLAIN, ScoreRule, attend
from shardwise.parallel.context.blocks import block_forward, block_pair
from shardwise.parallel.context.partial import PartialAttention
from shardwise.parallel.context.ring import block_keep


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, drop=None,
                        rule: ScoreRule = PLAIN) -> torch.Tensor:
    """Attention (causal, or not for an encoder) of this rank's queries ``[B, H, t, d]`` over the whole
    sequence's keys/values under the layer's ``rule``; ``drop``: the probabilities' dropout (None: none).
    A plain rule runs the ring's blocks; a sliding window or soft-cap runs :func:`~shardwise.model.scores.attend`
    once over every gathered key at the global positions (values may then be narrower than keys: latent
    attention)."""
    n, r, t = core.size, core.rank, q.shape[2]
    if k.shape == v.shape:
        every = _GatherReduceScatter.apply(torch.stack((k, v)).unsqueeze(0), 0, core.group, core.stats)
        keys, values = every[:, 0], every[:, 1]  # [n, B, Hkv, t, d]: one gather for both
    else:
        keys = _GatherReduceScatter.apply(k.unsqueeze(0), 0, core.group, core.stats)
        values = _GatherReduceScatter.apply(v.unsqueeze(0), 0, core.group, core.stats)
    if not rule.plain or k.shape != v.shape:
        return _attend_gathered(q, keys, values, core, drop, rule)
    scale = rule.scale_for(q.shape[-1])
    acc = PartialAttention(t, core.layout.balance == "headtail" and core.causal)
    for src in [r, *(j for j in range(n) if j != r)]:  # the diagonal first: it covers every row
        pair = block_pair(r, src, t, core.layout.balance, core.causal)
        if pair is None:
            continue
        keep = None if drop is None else block_keep(core, drop, q.shape[0], t, src, pair, q.device)
        with core.timed(q):
            out_b, lse_b = block_forward(q[:, :, pair.q], keys[src][:, :, pair.kv], values[src][:, :, pair.kv],
                                         scale, pair.causal, keep, 0.0 if drop is None else drop.p)
            acc.add(pair.q, out_b, lse_b)
        core.count_work(pair, t)
    return acc.result()[0].to(q.dtype)


def _attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, core, drop,
                     rule: ScoreRule) -> torch.Tensor:
    """This rank's queries over every rank's keys ``[n, B, Hkv, t, d]`` in one eager attention, masked by the
    global positions of both."""
    n, t = core.size, q.shape[2]
    q_pos = core.layout.positions(t, device=q.device)
    k_pos = torch.cat([core.layout.positions(t, rank=j, device=q.device) for j in range(n)])
    k_all, v_all = torch.cat(keys.unbind(0), dim=2), torch.cat(values.unbind(0), dim=2)
    keep = None if drop is None else drop.keep(q.shape[0], q_pos, k_pos, n * t, causal=core.causal)
    with core.timed(q):
        out = attend(q, k_all, v_all, rule, causal=core.causal, q_pos=q_pos, k_pos=k_pos, keep=keep,
                     p=0.0 if drop is None else drop.p)
    core.count_whole(n * t, fraction=1 / n)
    return out.to(q.dtype)
