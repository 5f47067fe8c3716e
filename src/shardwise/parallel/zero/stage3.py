"""ZeRO-3's parameter life cycle: gather before use, free after, prefetch the next unit.

Rajbhandari et al. 2020, "ZeRO", §5.3 (P_os+g+p) and Zhao et al. 2023, "PyTorch FSDP: Experiences
on Scaling Fully Sharded Data Parallel" (VLDB 16(12)), §3.3-3.4: a unit's parameters are
all-gathered just before its forward, freed right after it, gathered again when the gradient of
its output arrives (a tensor hook on the output, the "pre-backward" hook) and freed once its
gradients are reduce-scattered (in :mod:`.reduce`). While unit *i* computes, the gather of the
next unit (*i*+1 in forward, *i*-1 in backward) is already in flight (prefetch). The root unit
(embeddings, final norm, head) stays gathered from forward to the end of backward.

With hierarchical partitioning (ZeRO++ hpZ, :mod:`.hpz`) the forward gather also leaves a
secondary, node-sharded copy, and the backward gather runs inside the node from it.

A mixin of :class:`shardwise.parallel.zero.ZeroDataParallel`, kept apart because it is the one
piece only stage 3 needs.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from shardwise.dist.comm.counting import nbytes
from shardwise.parallel.zero import exchange
from shardwise.parallel.zero.flat import FlatUnit
from shardwise.parallel.zero.quant import all_gather_int8


class Stage3Hooks:
    """Gather / free / prefetch for the units of a ZeRO-3 engine (``self.units[0]`` is the root)."""

    @property
    def root(self) -> FlatUnit | None:
        """ZeRO-3's root unit (every parameter outside the block units), if there is one."""
        return self.units[0] if self.stage == 3 and self._has_root else None

    @property
    def block_units(self) -> list[FlatUnit]:
        """ZeRO-3's units of blocks (and experts), in forward order."""
        return self.units[1:] if self.root is not None else list(self.units)

    def _gather(self, unit: FlatUnit, wait: bool = True) -> None:
        """Make ``unit.full`` hold the unit's parameters (launch the gather; wait unless ``wait=False``).

        In backward, a unit with a secondary partition (hpZ) is gathered inside the node from it;
        otherwise over the whole group, and a forward gather that backward will repeat keeps a
        secondary partition once it completes."""
        if not unit.gathered and unit.gather_work is None:
            unit.alloc_full()
            if unit.world == 1:
                unit.full.copy_(unit.shard)
                unit.gathered = True
                return
            phase = "backward" if self._in_backward else "forward"
            if phase == "backward" and unit.secondary is not None:
                unit.gather_work = self.hpz.gather(unit, self.direct_exchange, on_send=self.comm_stats.send)
                unit.after_gather = self.hpz.drop
                self.comm_stats.hand(nbytes(unit.full), backend=not self.direct_exchange)
            else:
                dense = unit.group is self.group  # expert units, sliced over their replicas, keep no secondary
                traffic = phase if dense else None  # the node traffic: the data-parallel group's gathers
                if self.quant_weights:
                    unit.gather_work, handed = all_gather_int8(unit.full, unit.shard, unit.group)
                    if dense:
                        self.hpz.unmeasured(handed)
                else:
                    unit.gather_work = self._all_gather_work(unit, unit.shard, traffic)
                    handed = nbytes(unit.full)
                self.comm_stats.hand(handed, backend=self.quant_weights or not self.direct_exchange)
                keep = self.hpz.enabled and dense and phase == "forward" and unit.index > 0 and torch.is_grad_enabled()
                unit.after_gather = self.hpz.keep if keep else None
        if wait and unit.gather_work is not None:
            self._finish_gather(unit)

    def _all_gather_work(self, unit: FlatUnit, shard: torch.Tensor | None, phase: str | None = None):
        """Launch the all-gather of ``shard`` (``None``: the own slice of ``unit.full``, in place) into
        ``unit.full``: a direct exchange on gloo (:mod:`.exchange`), the backend's collective otherwise.
        A gather of ZeRO-3's ``phase`` ("forward", "backward") adds its messages to the node traffic."""
        if self.direct_exchange:
            return exchange.all_gather(unit.full, unit.group, shard, tag=exchange.TAG + 2 * unit.index + 1,
                                       on_send=self.comm_stats.send,
                                       on_send_to=self.hpz.counter(phase) if phase else None)
        if phase:
            self.hpz.unmeasured(nbytes(unit.full))
        if shard is None:
            shard = unit.shard.clone()
        return dist.all_gather_single(unit.full, shard, group=unit.group, async_op=True)

    def _finish_gather(self, unit: FlatUnit) -> None:
        unit.gather_work.wait()
        unit.gather_work = None
        unit.gathered = True
        if unit.after_gather is not None:
            unit.after_gather(unit)
            unit.after_gather = None

    def _free(self, unit: FlatUnit) -> None:
        if self.stage == 3 and not self._hold:  # a pipeline step keeps its units until the flush
            if unit.gather_work is not None:
                self._finish_gather(unit)
            unit.free_full()

    def _root_pre_forward(self, module, _args) -> None:
        """A chunk (the model, or one of a pipeline rank's chunks) starts: gather the root, prefetch the
        chunk's first unit."""
        if self.root is not None:
            self._gather(self.root)
        if (first := self._chunk_first_unit[id(module)]) is not None:
            self._gather(first, wait=False)

    def _root_post_forward(self, _module, _args, _output) -> None:
        if not torch.is_grad_enabled() and self.root is not None:
            self._free(self.root)

    def _unit_pre_forward_hook(self, module, _args) -> None:
        unit = self._module_unit[(id(module), "pre")]
        self._gather(unit)
        if unit.index + 1 < len(self.units):
            self._gather(self.units[unit.index + 1], wait=False)

    def _unit_post_forward_hook(self, module, _args, output):
        unit = self._module_unit[(id(module), "post")]
        self._free(unit)
        if torch.is_grad_enabled():
            for t in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(_PreBackward(self, unit))
        return output

    def _pre_backward(self, unit: FlatUnit) -> None:
        self._start_backward()
        self._gather(unit)
        if unit.index - 1 >= (1 if self.root is not None else 0):
            self._gather(self.units[unit.index - 1], wait=False)


class _PreBackward:
    """Tensor hook on a stage-3 unit's output: runs when the output's gradient is ready, i.e.
    just before the unit's own backward, and gathers the unit's parameters (plus a prefetch)."""

    def __init__(self, engine: Stage3Hooks, unit: FlatUnit):
        self.engine = weakref.ref(engine)
        self.unit = unit

    def __call__(self, grad: torch.Tensor) -> None:
        engine = self.engine()
        if engine is not None:
            engine._pre_backward(self.unit)
