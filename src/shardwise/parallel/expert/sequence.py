"""Mixture-of-experts blocks whose tokens of one sequence are spread over ranks (sequence or context parallelism).

Each rank routes only its own tokens: with sequence parallelism (Korthikanti et al. 2022 §4.2.2) a MoE block
between the sequence-parallel regions sees this rank's ``T / tp`` tokens, and with context parallelism
(Liu et al. 2023) this rank's ``T / cp``. Routing and the experts are per token, so they need nothing more
(dropless routing: a capacity would rank each expert's slots over the whole sequence). The router's losses
are averages over the micro-batch's tokens, and those are on several ranks:

* load balancing (Fedus et al. 2022, "Switch Transformers", eq. 4): ``E * sum_i f_i P_i``, where ``f_i`` is the
  fraction of all the sequence's slots routed to expert ``i`` -- the routed counts are summed over the ranks
  holding the sequence (no gradient flows through ``f``) -- and ``P_i`` the mean router probability over all
  its tokens;
* router z-loss (Zoph et al. 2022, "ST-MoE", eq. 5): the mean over all its tokens of ``(log sum exp z)^2``.

Both sums over tokens are taken as the main loss takes them. Over the tensor-parallel ranks (sequence
parallelism) the rank's partial sums are added with Megatron's g (all-reduce forward, identity backward), so
every tp rank holds the whole value and each token's gradient reaches only the rank holding it; the router's
and experts' partial weight gradients are then added over tp by the sequence-parallel gradient hooks, as for
every other weight outside the regions. Over the context-parallel ranks the loss is taken as
:class:`~shardwise.parallel.context.core.ContextParallelLoss` takes the language-model loss: each rank adds
``cp * (its partial sum) / (the sequence's token count)``, whose average over the cp ranks -- what the gradient
reduction over dp x cp computes -- is the single-process value and gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.counting import CommStats, nbytes
from shardwise.dist.functional import reduce_from_region
from shardwise.model.moe import moe_layers


class SequenceShardedRouterLosses:
    """``(aux, z)`` of a MoE block, unweighted, over the whole sequence its tokens belong to.

    ``tp_group``: the sequence-parallel group (``None`` without sequence parallelism); ``cp_group`` / ``cp``:
    the context-parallel group and size (``None`` / 1 without it)."""

    def __init__(self, tp_group: dist.ProcessGroup | None, cp_group: dist.ProcessGroup | None, cp: int,
                 stats: CommStats | None = None):
        self.tp_group, self.cp_group, self.cp, self.stats = tp_group, cp_group, cp, stats
        self.shards = (dist.get_world_size(tp_group) if tp_group is not None else 1) * cp
        """Ranks over which one sequence's tokens are spread (equal shares)."""

    def __call__(self, probs: torch.Tensor, logits: torch.Tensor, routed: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        e = probs.shape[-1]
        routed = routed.detach().clone()
        for group in (self.tp_group, self.cp_group):
            if group is not None:
                if self.stats is not None:
                    self.stats.hand(nbytes(routed), backend=True)
                dist.all_reduce(routed, group=group)
        f = routed.to(probs.dtype) / routed.sum().clamp(min=1)
        sums = torch.cat([probs.sum(0), torch.logsumexp(logits.float(), dim=-1).pow(2).sum().reshape(1)])
        if self.tp_group is not None:
            sums = reduce_from_region(sums, self.tp_group, self.stats)
        scale = self.cp / (probs.shape[0] * self.shards)  # cp * (sum over this cp shard) / (tokens of the sequence)
        return e * (f * sums[:e]).sum() * scale, sums[e] * scale


def shard_router_losses(part: nn.Module, tp_group: dist.ProcessGroup | None, cp_group: dist.ProcessGroup | None,
                        cp: int, stats: CommStats | None = None) -> int:
    """Give every MoE block of ``part`` the whole sequence's router losses; returns how many blocks."""
    layers = moe_layers(part)
    for moe in layers:
        if moe.capacity_factor:
            raise ValueError(f"a MoE block with capacity factor {moe.capacity_factor} cannot route a sequence spread "
                             "over ranks: its capacity ranks each expert's slots over the whole sequence")
        moe.router_losses = SequenceShardedRouterLosses(tp_group, cp_group, cp, stats)
    return len(layers)
