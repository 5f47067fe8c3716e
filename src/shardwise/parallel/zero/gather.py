"""ZeRO-1/2's parameter all-gather after the optimizer step, overlapped with the next forward.

After the optimizer step each rank holds updated values only in its own slice of every unit; an all-gather
per unit refills the full parameters (Rajbhandari et al. 2020, "ZeRO", §5.1-5.2). Waiting for every unit
before the next forward leaves the whole gather exposed. Instead (Megatron-Core's distributed optimizer with
``--overlap-param-gather``; the same idea as ZeRO-3's prefetch, Zhao et al. 2023 "PyTorch FSDP" §3.4):

* :meth:`ParamGather.after_step` launches every unit's all-gather **in forward order** (the units are built in
  reverse registration order, so the last unit holds the embedding) and returns without waiting;
* a forward pre-hook on every module that holds parameters of a unit (its own ``_parameters``; a tied weight
  registered in two modules is waited for by both) waits for **its own units only** -- the first block's
  forward runs while the later blocks' parameters are still travelling. In a pipeline the first micro-batch's
  forward on each chunk is what waits; later micro-batches find them done;
* whatever reads parameters outside a module's forward (a checkpoint, :meth:`wait_for_params`), or writes
  the slices again (the next optimizer step), waits for every pending gather first.

``overlap_param_gather=False`` waits for every gather inside :meth:`after_step` (the plain ZeRO step).
ZeRO-3 gathers around each unit's forward and backward instead (:mod:`.stage3`). The time a pre-hook waits
is the exposed part of the gather (``dp_exposed_s``, :mod:`shardwise.dist.comm.counting`).

A mixin of :class:`shardwise.parallel.zero.ZeroDataParallel`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from shardwise.dist.comm.counting import nbytes
from shardwise.parallel.zero.flat import FlatUnit


def forward_order(units: list) -> list:
    """The order ZeRO-1/2 launch their parameter gathers: the units' reverse (a unit of the last registered
    parameters -- the head -- is built first, :func:`shardwise.parallel.data._assign_buckets`). The simulator
    issues its gathers in this order too (:mod:`shardwise.sim.step`)."""
    return list(reversed(units))


class _WaitForUnits:
    """Forward pre-hook of one module: wait for the pending gathers of the units holding its parameters."""

    def __init__(self, engine, units: list[FlatUnit]):
        self.engine = weakref.ref(engine)
        self.units = units

    def __call__(self, module: nn.Module, args) -> None:
        engine = self.engine()
        if engine is not None:
            for u in self.units:
                if u.gather_work is not None:
                    engine._finish_param_gather(u)


class ParamGather:
    """The all-gather of ZeRO-1/2's updated parameters, launched after the step, waited for per module."""

    def _install_gather_hooks(self) -> None:
        """Stages 1-2 with ``overlap_param_gather``: a pre-hook on every module owning parameters of a unit."""
        self._gather_hooks = []
        if self.stage == 3 or not self.overlap_param_gather or all(u.world == 1 for u in self.units):
            return
        for module in self.module.modules():
            units = {id(u): u for p in module._parameters.values()
                     if p is not None and (u := self._unit_of.get(id(p))) is not None}
            if units:
                ordered = [u for u in forward_order(self.units) if id(u) in units]
                self._gather_hooks.append(module.register_forward_pre_hook(_WaitForUnits(self, ordered)))

    @torch.no_grad()
    def after_step(self) -> None:
        """Write the updated master pieces into the shards and (stages 1, 2) all-gather the full parameters,
        launched in forward order; waited for here, or (``overlap_param_gather``) by each module's pre-hook."""
        self.wait_for_params()  # a unit no forward used may still be in flight: its slice is about to change
        self.masters.write_back(self.units)
        for u in self.units:  # a secondary partition (hpZ) holds the old values
            self.hpz.drop(u)
        if self.stage == 3:
            return
        for u in forward_order(self.units):  # in place: the rank's slice of ``full`` holds the updated values
            if u.world == 1:
                continue
            u.gather_work = self._all_gather_work(u, None)
            self.comm_stats.hand(nbytes(u.full), backend=not self.direct_exchange)
        if not self.overlap_param_gather:
            self.wait_for_params()

    def _finish_param_gather(self, unit: FlatUnit) -> None:
        self.comm_stats.wait(unit.gather_work)
        unit.gather_work = None

    def wait_for_params(self) -> None:
        """Wait for every stage-1/2 parameter gather still in flight (before reading or writing parameters
        outside a module's forward)."""
        if self.stage == 3:
            return
        for u in forward_order(self.units):
            if u.gather_work is not None:
                self._finish_param_gather(u)

    def pending_param_gathers(self) -> int:
        """Units whose parameter gather has not been waited for yet."""
        return sum(u.gather_work is not None for u in self.units) if self.stage < 3 else 0
