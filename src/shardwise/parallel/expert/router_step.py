"""What the routers do once per optimizer step: their load summed over the global batch, the balancing
biases moved, the load reported, and a warning when the routing collapses onto a few experts.

Each data-parallel (and context-parallel) rank routes only its own tokens, so its router sums
(:class:`~shardwise.model.moe.RouterTotals`: per block and expert the kept slots, the routed slots -- the
load, Switch's ``f`` -- and the summed probabilities -- Switch's ``P``; all plain sums) are added over the
gradient-reduction group, which spans dp x cp: the global batch's load, the same on every rank. From it every
rank moves the biases of its ``sigmoid_bias`` routers identically (:func:`shardwise.model.router.update_expert_bias`),
so the bias never differs between ranks and needs no broadcast. Pipeline stages then join their blocks'
sums for the metrics. Tensor-parallel ranks route the same tokens the same way (MoE blocks are whole on
them) and are not summed over -- but for sequence parallelism, where each routes its share of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.model.moe import TAIL, RouterTotals, moe_layers, moe_metrics, pop_moe_totals
from shardwise.model.router import update_expert_bias
from shardwise.train.readout import copy_to_host

COLLAPSE_FACTOR = 2.0
"""An expert is overloaded when it takes more than this many times its fair share ``k / E`` of the tokens."""
COLLAPSE_STEPS = 20
"""...in this many consecutive steps: then :class:`CollapseWatch` warns once."""


@dataclass(frozen=True)
class StageBlocks:
    """Which MoE blocks each pipeline stage holds (``layers[s]``: stage ``s``'s block ids, in order), each with
    ``experts`` experts."""

    layers: list[list[int]]
    experts: int

    @classmethod
    def gather(cls, model: nn.Module, pp_group: dist.ProcessGroup, experts: int) -> StageBlocks:
        """An object gather over ``pp_group``: once, when the engine is built (the blocks never move)."""
        stages: list[list[int] | None] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, [m.layer_id for m in moe_layers(model)], group=pp_group)
        return cls([list(s or []) for s in stages], experts)


def router_step(model: nn.Module, group: dist.ProcessGroup | None,
                pp_group: dist.ProcessGroup | None = None, seq_group: dist.ProcessGroup | None = None,
                skipped: torch.Tensor | None = None, stages: StageBlocks | None = None,
                device: torch.device | None = None) -> Callable[[], dict[str, float | list[int]]]:
    """After an optimizer step: this step's router sums added over ``group`` (a collective where the model has
    MoE blocks), each ``sigmoid_bias`` router's bias moved by the global load of its block -- all on the device --,
    and the sums' copy to the host queued without waiting. Returns the reader of the metrics of
    :func:`shardwise.model.moe.moe_metrics`: call it once the device is past the step (the loop reads it one step
    late, :class:`~shardwise.train.readout.Late`). ``pp_group`` (a collective on every stage, with or without MoE
    blocks, on ``device``): each stage's blocks joined for the metrics by one tensor gather on the device, the
    stages' sums laid out as ``stages`` says (:meth:`StageBlocks.gather`), so nothing waits for the host.
    ``seq_group`` (sequence parallelism's tp group): its ranks routed different tokens of the same sequences, so
    their counts -- not the losses, which each of them holds for the whole sequence (:mod:`.sequence`), nor the
    forwards -- are added over it first. ``skipped``: a
    0-dim flag on the device, 1 when the optimizer step was skipped (:mod:`shardwise.train.step_guard`): the biases
    then stay where they are, as the weights do (no host reads it)."""
    totals = pop_moe_totals(model)
    if totals is not None and seq_group is not None and dist.get_world_size(seq_group) > 1:
        n = totals.counts.numel()
        partial = totals.flat()[:n + 3]  # counts, then tokens, routed and dropped slots
        dist.all_reduce(partial, group=seq_group)
        totals = totals.with_flat(torch.cat([partial, totals.tail[3:]]))
    if totals is not None and group is not None and dist.get_world_size(group) > 1:
        flat = totals.flat()
        dist.all_reduce(flat, group=group)
        totals = totals.with_flat(flat)
    if totals is not None:
        for moe, load in zip(moe_layers(model), totals.counts[:, 1], strict=True):
            update_expert_bias(moe.router, load, moe.bias_rate, skipped)
    if pp_group is not None:
        if stages is None:
            raise ValueError("a pipeline's router step needs each stage's MoE blocks (StageBlocks.gather)")
        totals = _join_stages(totals, stages, pp_group, device)
    copied = None
    if totals is not None:  # the reader waits for this copy's event, not for the device's later work
        flat, copied = copy_to_host(totals.flat())
        totals = totals.with_flat(flat)

    def read() -> dict[str, float | list[int]]:
        if copied is not None:
            copied.synchronize()
        return {} if totals is None else moe_metrics(totals)

    return read


class CollapseWatch:
    """Warns once when a router sends one expert more than ``COLLAPSE_FACTOR x k / E`` of a step's tokens
    (its fair share is ``k / E``: each token picks k of E) in ``COLLAPSE_STEPS`` consecutive steps -- the
    routing collapse that load balancing exists to prevent (Shazeer et al. 2017, §4; Fedus et al. 2022, §2.2).
    Where even the whole batch would not exceed that share (``2k >= E``), halfway between the fair share and
    all tokens counts as overloaded."""

    def __init__(self, n_experts: int, top_k: int):
        fair = top_k / n_experts if n_experts else 1.0
        self.limit = fair * COLLAPSE_FACTOR if fair * COLLAPSE_FACTOR < 1 else (fair + 1) / 2
        self.fair = fair
        self.streak: dict[str, int] = {}
        self.warned: set[str] = set()

    def check(self, step: int, metrics: dict) -> str | None:
        """One line the first time a block's busiest expert has been overloaded ``COLLAPSE_STEPS`` steps in a
        row (read from the step's ``moe_load_layer{i}`` metrics), else None."""
        notes = []
        for key, load in metrics.items():
            if not key.startswith("moe_load_layer") or not load:
                continue
            tokens = sum(load) / (self.fair * len(load))  # slots = k * tokens and fair * E = k
            busiest = max(range(len(load)), key=load.__getitem__)
            share = load[busiest] / tokens if tokens else 0.0
            self.streak[key] = self.streak.get(key, 0) + 1 if share > self.limit else 0
            if self.streak[key] >= COLLAPSE_STEPS and key not in self.warned:
                self.warned.add(key)
                layer = key.removeprefix("moe_load_layer")
                notes.append(f"warning: router collapse in block {layer} at step {step}: expert {busiest} took "
                             f"{share:.0%} of the tokens for {COLLAPSE_STEPS} steps (fair share {self.fair:.0%}); "
                             "raise model.moe_aux_coeff, use model.moe_router='sigmoid_bias' or lower train.lr")
        return "; ".join(notes) or None


def _join_stages(totals: RouterTotals | None, stages: StageBlocks, pp_group: dist.ProcessGroup,
                 device: torch.device | None) -> RouterTotals | None:
    """Every stage's sums joined as one model's (:meth:`RouterTotals.join`), on the device: each stage sends one
    row of a fixed width -- its tail, then its counts, zero-padded to the widest stage's -- in one all-gather."""
    if not any(stages.layers):
        return None
    per_block = 3 * stages.experts  # kept slots, routed slots, summed probability per expert
    width = TAIL + max(len(layers) for layers in stages.layers) * per_block
    row = torch.zeros(width, dtype=torch.float64, device=totals.tail.device if totals is not None else device)
    if totals is not None:
        row[:TAIL + totals.counts.numel()] = torch.cat([totals.tail, totals.counts.reshape(-1)])
    rows = [torch.empty_like(row) for _ in stages.layers]
    dist.all_gather(rows, row, group=pp_group)
    return RouterTotals.join([RouterTotals(layers, r[TAIL:TAIL + len(layers) * per_block].view(len(layers), 3, -1),
                                           r[:TAIL]) for layers, r in zip(stages.layers, rows, strict=True) if layers])
