"""Expert parallelism without host synchronisation: every rank sends each expert exactly its capacity of rows.

The dispatch of :mod:`.dispatch` moves each expert's tokens by an all-to-all of uneven splits, which the host
must know before it can post the exchange: one read of the exchanged counts per MoE layer, a host
synchronisation on a GPU. With a capacity factor (``model.moe_capacity_factor`` > 0) no expert keeps more than
``C = ceil(cf * k * N / E)`` slots of a forward's ``N`` tokens (Switch Transformers, Fedus et al. 2022, §2.2),
so the slots can be laid out padded, ``C`` rows per expert -- GShard's dispatch tensor ``[E, C, d]`` (Lepikhin
et al. 2021, §2.2) -- and the all-to-all has equal splits known before any token is routed: nothing is read
back, as in Megatron-Core's drop-and-pad token dispatcher and torchtitan's expert parallelism with fixed
capacity (``parallel.ep_dispatch = "padded"``).

Two swaps, made from outside on each MoE block (:func:`apply_padded_dispatch`):

* the block's slot assignment (:meth:`shardwise.model.moe.MoE.slots`) becomes :func:`padded_slots`: the same
  kept slots in the same order as :func:`~shardwise.model.moe.assign` (a slot is kept when its place among its
  expert's earlier slots, choice-major, is below ``C``), expert ``e``'s at rows ``e C ..``; the rows a run does
  not fill are pads, token 0 with gate 0, so they add exactly nothing when the outputs are combined;
* the experts become :class:`PaddedExpertParallel`: ``[E C, d]`` to ``[ep, E / ep, C, d]`` by one all-to-all of
  equal blocks, each local expert's ``ep C`` rows through one batched matmul, and back by the reverse one.

The trained model equals one process's with the same capacity and micro-batches (the same slots are kept; the
pads compute rows that are multiplied by zero), at the cost of computing ``E C`` rows where the exchanging
dispatch computes only the kept ones.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shardwise.model.moe import MoE, Routing, capacity, count_per_expert, moe_layers
from shardwise.parallel.expert.dispatch import ExpertParallel, apply_expert_parallel, dispatch


def padded_slots(experts: torch.Tensor, gates: torch.Tensor, n_experts: int, capacity_factor: float) -> Routing:
    """The slots of each token's choices ``experts [N, k]`` (gates ``[N, k]``) kept under the capacity
    ``C`` (:func:`~shardwise.model.moe.capacity`), laid out ``C`` rows per expert (module docstring): a
    :class:`~shardwise.model.moe.Routing` of ``E * C`` rows whose ``counts`` are the kept slots per expert and
    whose ``dropped`` is a tensor. No host synchronisation."""
    n, top_k = experts.shape
    e = n_experts
    cap = capacity(n, top_k, e, capacity_factor)
    slot_expert = experts.t().reshape(-1)  # choice-major: slot j*N + t
    slot_gate = gates.t().reshape(-1)
    slot_token = torch.arange(n, device=experts.device).repeat(top_k)
    routed = count_per_expert(slot_expert, e)
    onehot = slot_expert[:, None] == torch.arange(e, device=experts.device)  # one_hot would check the ids on the host
    position = (onehot.long().cumsum(0) - 1).gather(1, slot_expert[:, None]).squeeze(1)
    keep = position < cap
    row = torch.where(keep, slot_expert * cap + position, e * cap)  # a dropped slot goes to a spare row, cut off
    token = torch.zeros(e * cap + 1, dtype=slot_token.dtype, device=experts.device).scatter_(0, row, slot_token)
    gate = slot_gate.new_zeros(e * cap + 1).scatter(0, row, slot_gate)
    counts = torch.zeros(e, dtype=torch.int64, device=experts.device).index_add_(0, slot_expert, keep.long())
    return Routing(token[:-1], gate[:-1], counts, routed, n * top_k - counts.sum())


class PaddedExpertParallel(ExpertParallel):
    """This rank's ``E / ep`` experts fed ``C`` rows per expert from every rank (module docstring).
    ``forward(x, counts)`` takes the block's padded rows ``[E * C, d]`` and returns their outputs in the same
    layout (the pads' outputs are rows multiplied by a zero gate); ``counts`` is not read."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        cap = x.shape[0] // self.n_experts
        splits = [n_local * cap] * ep  # equal, known before routing: nothing to exchange or read
        arrived = dispatch(x, splits, splits, self.group, self.algorithm, self.stats, self.timeout_s)
        rows = arrived.view(ep, n_local, cap, -1).transpose(0, 1).reshape(n_local, ep * cap, -1)
        y = self.mlp(rows, lambda layer, h: layer.batched(h))  # [n_local, ep * C, d]: one batched matmul per map
        back = y.view(n_local, ep, cap, -1).transpose(0, 1).reshape(ep * n_local * cap, -1)
        return dispatch(back, splits, splits, self.group, self.algorithm, self.stats, self.timeout_s)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, padded to capacity"


def apply_padded_dispatch(model: nn.Module, group, stats=None, algorithm: str = "pairwise",
                          timeout_s: float | None = None) -> nn.Module:
    """Expert parallelism over ``group`` with the padded dispatch: every MoE block of ``model`` (holding real
    values; ``capacity_factor`` > 0) gets its share of the experts as a :class:`PaddedExpertParallel` and assigns
    its slots by :func:`padded_slots` (replaced on the instance); returns ``model``."""
    for moe in moe_layers(model):
        if moe.capacity_factor <= 0:
            raise ValueError("the padded dispatch needs model.moe_capacity_factor > 0: without a capacity no "
                             "expert's rows are bounded")
        moe.slots = functools.partial(_slots, moe)
    return apply_expert_parallel(model, group, stats, algorithm, timeout_s, experts_class=PaddedExpertParallel)


def _slots(moe: MoE, experts: torch.Tensor, gates: torch.Tensor) -> Routing:
    return padded_slots(experts, gates, moe.n_experts, moe.capacity_factor)
