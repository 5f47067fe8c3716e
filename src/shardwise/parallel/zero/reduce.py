"""Gradient reduction during backward for ZeRO stages 1-3: when each unit's gradients are ready,
reduce-scatter them so that each rank receives the summed slice it owns.

Rajbhandari et al. 2020, "ZeRO", §5.1-5.3, with the bucketing of Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 13(12)), §3.2.3: a
post-accumulate-grad hook counts each unit's gradients; once a unit is complete (and every unit
before it in the fixed reduction order has been launched) its gradients are flattened, divided by
N and reduce-scattered; what is left (units with a parameter that got no gradient) is reduced at
the end of backward, in the same order on every rank. The end-of-backward callback then hands each
master piece its gradient slice (:class:`.offload.MasterStore`).

A mixin of :class:`shardwise.parallel.zero.ZeroDataParallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.zero import exchange
from shardwise.parallel.zero.flat import FlatUnit
from shardwise.parallel.zero.quant import reduce_scatter_int8


class GradReduction:
    """Backward-time hooks of a ZeRO engine: count, reduce-scatter, hand the slices to the masters."""

    def _reset(self) -> None:
        self._in_backward = False
        self._inflight: list[tuple[FlatUnit, torch.Tensor, torch.Tensor, dist.Work | None]] = []
        self._next = 0  # position in ``_order`` of the next unit to reduce
        for u in self.units:
            u.pending = len(u.params)
            u.ready = False

    def _start_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._start_backward()
        self._drain(keep=0, only_completed=True)  # release finished staging buffers early
        self._had_grad[self._flag_index[id(param)]] = 1
        unit = self._unit_of[id(param)]
        unit.pending -= 1
        if unit.pending == 0:
            if self.stage == 3 and unit.index > 0:  # parameters first, as FSDP2: lowers the peak
                self._free(unit)
            unit.ready = True
            while self._sync and self._next < len(self._order) and self._order[self._next].ready:
                self._reduce(self._order[self._next])  # overlapped with the rest of backward
                if not self.overlap_reduce:
                    self._drain(keep=0)

    def _reduce(self, unit: FlatUnit) -> None:
        """Launch one unit's reduce-scatter. Units are reduced in the fixed order ``_order`` (the
        order backward normally readies them) on every rank, so that collectives match even when
        a parameter gets a gradient on some ranks only (a unit ready early waits for its turn)."""
        self._next += 1
        if self.stage == 1:  # in place
            self._stage1_flatten(unit)
            self._launch(unit, unit.grad_full)
        else:
            self._reduce_scatter(unit)

    def _reduce_scatter(self, unit: FlatUnit) -> None:
        """Stages 2/3: launch the reduce-scatter of one unit's gradients and free the full-size ones.

        The previous unit's reduce-scatter (in flight during this unit's backward) is finished
        first, so at most one staging buffer exists at a time (one unit's worth, not two, at
        the peak: this unit's gradients plus its staging copy)."""
        self._drain(keep=0)
        flat = unit.flat_grad(self.world)
        for p in unit.params:
            p.grad = None
        self._launch(unit, flat)

    def _launch(self, unit: FlatUnit, flat: torch.Tensor) -> None:
        """Reduce-scatter ``flat`` (a unit's divided gradients). Stage 1 reduces in place: the
        output is the rank's own slice of the input (NCCL's documented in-place form; gloo
        computes the same, which the equivalence tests check), so no extra gradient shard exists."""
        if self.world == 1:
            self._inflight.append((unit, flat, flat, None))
            return
        if self.stage == 1:
            out = unit.own_slice(flat)
        else:
            out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
        if self.quant_grads:
            work, nbytes = reduce_scatter_int8(out, flat, self.group)
            self.comm_bytes_last_step += nbytes
        else:
            work = self._reduce_scatter_work(out, flat, unit)
            self.comm_bytes_last_step += flat.numel() * flat.element_size()
        self._inflight.append((unit, flat, out, work))

    def _reduce_scatter_work(self, out: torch.Tensor, flat: torch.Tensor, unit: FlatUnit):
        """Launch the reduce-scatter of ``flat`` into ``out``: a direct exchange on gloo (:mod:`.exchange`),
        the backend's collective otherwise."""
        if self.direct_exchange:
            return exchange.reduce_scatter(out, flat, self.group, tag=exchange.TAG + 2 * unit.index)
        return dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End-of-backward callback: reduce what is left, wait, hand each master piece its gradient."""
        try:
            if self._sync:
                while self._next < len(self._order):
                    self._reduce(self._order[self._next])
                self._drain(keep=0)
                self._agree_on_grads()
                self.masters.set_grads(self.units)
            if self.stage == 3:
                for u in self.units:
                    self._free(u)
                    self.hpz.drop(u)
        finally:
            self._reset()

    def _agree_on_grads(self) -> None:
        """Give every unit ``had_grad``: per parameter, whether any rank produced a gradient."""
        flags = torch.tensor(list(self._had_grad), dtype=torch.uint8, device=self.units[0].shard.device)
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            self.comm_bytes_last_step += flags.numel()
            self.all_reduce_bytes_last_step += flags.numel()  # of comm_bytes: all-reduced, not scattered
        flags, base = flags.tolist(), 0
        for u in self.units:
            u.had_grad = [bool(f) for f in flags[base:base + len(u.params)]]
            base += len(u.params)

    def _drain(self, keep: int, only_completed: bool = False) -> None:
        """Wait for the oldest reduce-scatters until at most ``keep`` are in flight (with
        ``only_completed``, just collect those already finished); add each result into its unit's
        gradient shard and release the staging buffer.

        Collecting finished ones from every gradient hook frees a unit's staging buffer early in
        the next unit's backward instead of at its end: the buffer is a whole unit of gradients,
        and keeping it through the next unit's backward raised the peak by that much."""
        while len(self._inflight) > keep:
            u, _flat, out, work = self._inflight[0]
            if only_completed and work is not None and not work.is_completed():
                return
            self._inflight.pop(0)
            if work is not None:
                work.wait()
            if self.stage == 1 or u.grad_shard is None:
                u.grad_shard = out
            else:
                u.grad_shard += out
            self.masters.grad_ready(u)

    def _stage1_flatten(self, u: FlatUnit) -> None:
        """Stage 1: make each ``.grad`` a view of the unit's persistent flat gradient, divided by N."""
        for p, off, n in zip(u.params, u.offsets, u.numels, strict=True):
            view = u.grad_full[off:off + n].view(p.shape)
            if p.grad is None:
                continue
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        u.grad_full.div_(self.world)

