"""Gradient reduction during backward for ZeRO stages 1-3: when each unit's gradients are ready,
reduce-scatter them so that each rank receives the summed slice it owns.

Rajbhandari et al. 2020, "ZeRO", §5.1-5.3, with the bucketing of Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 13(12)), §3.2.3: a
post-accumulate-grad hook counts each unit's gradients; once a unit is complete (and every unit
before it in the fixed reduction order has been launched) its flat gradient -- stage 1's persistent
buffer, or for stages 2/3 this backward's buffer, into which a tensor hook lets autograd accumulate
each gradient directly -- is divided by N and reduce-scattered; what is left (units with a
parameter that got no gradient) is reduced at the end of backward, in the same order on every rank.
The end-of-backward callback then hands each master piece its gradient slice
(:class:`.offload.MasterStore`). Stage 2 keeps two flat buffers for reuse (:class:`BufferPool`).

A mixin of :class:`shardwise.parallel.zero.ZeroDataParallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.allreduce import all_reduce
from shardwise.dist.comm.counting import nbytes
from shardwise.parallel.zero import exchange
from shardwise.parallel.zero.flat import FlatUnit
from shardwise.parallel.zero.quant import reduce_scatter_int8


def overlaps_reduce(stage: int, on_gpu: bool, requested: bool = True) -> bool:
    """Whether ZeRO's reduce-scatters run beside backward (``ZeroDataParallel(overlap_reduce=)``): stages 1-2 as
    ``requested`` (``parallel.zero_overlap_grad_reduce``) on every device, stage 3 on GPUs only (see the wrapper's
    ``overlap_reduce``). The simulator asks the same (:mod:`shardwise.sim.step`)."""
    return requested if stage < 3 else on_gpu


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
        if not self._in_backward and not self._hold:  # a pipeline step reduces once, after its flush
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._had_grad[self._flag_index[id(param)]] = 1
        if self._hold and not self._final:  # a pipeline step: only the flag; reduced after the flush
            return
        if not self._hold:
            self._start_backward()
        self._drain(keep=0, only_completed=True)  # release finished staging buffers early
        unit = self._unit_of[id(param)]
        unit.pending -= 1
        if unit.pending == 0:
            if self.stage == 3 and unit.index > 0:  # parameters first, as FSDP2: lowers the peak
                self._free(unit)
            unit.ready = True
            self._reduce_ready()

    def _reduce_ready(self) -> None:
        """Launch every unit whose gradients are complete, in the fixed order (overlapped with the rest of
        backward); inside a pipeline's last backward of a chunk, up to the first unit the flush still changes."""
        while (self._sync or self._final) and self._next < len(self._order) and self._order[self._next].ready:
            if self._hold and id(self._order[self._next]) in self._late:
                return
            if self._hold and self._held_at_first is None:  # the step's gradients are all there: its peak
                self._held_at_first = self._held_bytes()
            self._reduce(self._order[self._next])
            if self.overlap_reduce:  # left running beside the rest of backward
                self._reduced_early += 1
            else:  # waited for at once: the reference the overlap must equal
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

    @torch.no_grad()
    def _into_flat_grad(self, index: int) -> None:
        """Stages 2/3, tensor hook on parameter ``index`` just before autograd accumulates its gradient:
        make its ``.grad`` its place in the unit's flat gradient buffer (holding what it accumulated in
        earlier micro-batches, else zeros), so the gradient is added straight into the buffer that is
        reduce-scattered -- no gradient tensor of its own, no copy into a staging buffer (as DDP's
        ``gradient_as_bucket_view``, Li et al. 2020 §3.2.3, for a buffer that lives one backward)."""
        if not self._sync and not self._hold:  # inside no_sync: gradients accumulate in the parameters' own .grad
            return
        p = self._params[index]
        unit, i = self._unit_of[id(p)], self._position[id(p)]
        if unit.grad_flat is not None and unit.grad_filled[i]:
            return
        view = unit.grad_view(i, self._alloc(unit))
        if p.grad is not None:
            view.copy_(p.grad)
        else:
            view.zero_()
        p.grad = view

    def _reduce_scatter(self, unit: FlatUnit) -> None:
        """Stages 2/3: launch the reduce-scatter of one unit's flat gradient and release the parameters' ``.grad``.

        The previous unit's reduce-scatter (in flight during this unit's backward) is finished
        first, so at most one flat gradient is in flight at a time."""
        self._drain(keep=0)
        self._launch(unit, unit.take_flat_grad(self.world, self._alloc(unit)))

    def _alloc(self, unit: FlatUnit):
        # a pipeline step holds every unit's flat gradient at once: a kept buffer only of the very size
        return lambda numel: self._grad_pool.take(numel, unit.dtype, unit.full.device, exact=self._hold)

    def _launch(self, unit: FlatUnit, flat: torch.Tensor) -> None:
        """Reduce-scatter ``flat`` (a unit's divided gradients). Stage 1 reduces in place: the
        output is the rank's own slice of the input (NCCL's documented in-place form; gloo
        computes the same, which the equivalence tests check), so no extra gradient shard exists.
        With ``reduce_dtype`` the collective runs on a copy cast to it (the wire), and :meth:`_drain`
        casts the slice back."""
        if unit.world == 1:
            self._inflight.append((unit, flat, flat, None))
            return
        wire = flat
        if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
            wire = flat.to(self.reduce_dtype)
            if self.stage > 1:  # the flat gradient is copied: its buffer serves the next unit at once
                self._grad_pool.give(flat)
        if self.stage == 1:
            out = unit.own_slice(wire)
        else:
            out = torch.empty(unit.shard_numel, dtype=wire.dtype, device=wire.device)
        if self.quant_grads:
            work, handed = reduce_scatter_int8(out, wire, unit.group)
            self.comm_stats.hand(handed, backend=True)
        else:
            work = self._reduce_scatter_work(out, wire, unit)
            self.comm_stats.hand(nbytes(wire), backend=not self.direct_exchange)
        self._inflight.append((unit, wire, out, work))

    def _reduce_scatter_work(self, out: torch.Tensor, flat: torch.Tensor, unit: FlatUnit):
        """Launch the reduce-scatter of ``flat`` into ``out``: a direct exchange on gloo (:mod:`.exchange`,
        receiving into a pooled scratch buffer), the backend's collective otherwise."""
        if self.direct_exchange:
            need = exchange.scratch_numel(out, flat, unit.world)
            scratch = self._grad_pool.take(need, flat.dtype, flat.device) if need else None
            work = exchange.reduce_scatter(out, flat, unit.group, tag=exchange.TAG + 2 * unit.index, scratch=scratch,
                                           on_send=self.comm_stats.send)
            if scratch is not None:
                work.after = lambda: self._grad_pool.give(scratch)
            return work
        return dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=unit.group, async_op=True)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End-of-backward callback: reduce what is left, wait, hand each master piece its gradient."""
        try:
            if self._sync:
                self._reduce_rest()
            if self.stage == 3:
                for u in self.units:
                    self._free(u)
                    self.hpz.drop(u)
        finally:
            self._reset()

    def _reduce_rest(self) -> None:
        """Reduce the units not reduced yet, wait for every reduction, hand each master its slice."""
        self.overlapped_units_last_step, self._reduced_early = self._reduced_early, 0
        while self._next < len(self._order):
            self._reduce(self._order[self._next])
        self._drain(keep=0)
        self._agree_on_grads()
        self.masters.set_grads(self.units)

    def _agree_on_grads(self) -> None:
        """Give every unit ``had_grad``: per parameter, whether any rank produced a gradient (the maximum of the
        ranks' flags). Where this rank produced every gradient -- each step of a model without unused parameters --
        the answer is all True whatever the others say: its flags are made on the device (no upload) and the
        agreed ones are not read back, so the host never waits; the collective still runs, as the ranks that
        lack a gradient need it (they upload their flags and read the answer)."""
        device = self.units[0].shard.device
        everything = all(self._had_grad)
        flags = torch.ones(len(self._had_grad), dtype=torch.uint8, device=device) if everything else \
            torch.tensor(list(self._had_grad), dtype=torch.uint8, device=device)
        with self.comm_stats.waiting():  # a blocking collective: the compute thread waits all of it
            if self.world > 1 and self.direct_exchange:  # our ring on gloo: every byte counted where it is sent
                all_reduce(flags, "max", self.group, "ring", verify=False, stats=self.comm_stats)
            elif self.world > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
                self.comm_stats.hand(nbytes(flags), backend=True)
        agreed, base = [True] * len(self._had_grad) if everything else flags.tolist(), 0
        for u in self.units:
            u.had_grad = [bool(f) for f in agreed[base:base + len(u.params)]]
            base += len(u.params)

    def _drain(self, keep: int, only_completed: bool = False) -> None:
        """Wait for the oldest reduce-scatters until at most ``keep`` are in flight (with
        ``only_completed``, just collect those already finished); add each result into its unit's
        gradient shard and release the staging buffer.

        Collecting finished ones from every gradient hook frees a unit's staging buffer early in
        the next unit's backward instead of at its end: the buffer is a whole unit of gradients,
        and keeping it through the next unit's backward raised the peak by that much."""
        while len(self._inflight) > keep:
            u, flat, out, work = self._inflight[0]
            if only_completed and work is not None and not work.is_completed():
                return
            self._inflight.pop(0)
            self.comm_stats.wait(work)
            if torch.promote_types(out.dtype, u.dtype) != out.dtype:  # reduced in a narrower ``reduce_dtype``:
                out = u.own_slice(u.grad_full).copy_(out) if self.stage == 1 else out.to(u.dtype)  # back to the flat's
            # (a wider one, e.g. fp32 beside bf16 flat gradients, stays so: the optimizer's masters read it in fp32)
            if self.stage == 1 or u.grad_shard is None:
                u.grad_shard = out
            else:
                u.grad_shard += out
            if flat.dtype == u.dtype and flat is not u.grad_full and \
                    out.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                self._grad_pool.give(flat)  # a flat gradient of one backward: its memory serves the next unit
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


class BufferPool:
    """Flat buffers kept for reuse: the flat gradient a unit reduce-scatters, and the exchange's receive
    scratch, are handed back once the reduce-scatter is done and serve the next unit (and the next
    step), instead of being returned to the system and faulted in again (about 0.35 ms per MB on this
    CPU, the same order as the copies themselves). DeepSpeed's ZeRO-2 keeps such contiguous gradient
    buckets (Rajbhandari et al. 2020 §5.2: gradients are bucketized and reduced a bucket at a time).

    At most ``keep`` buffers are kept (the largest); more in use at once are allocated and freed as usual.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self.free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, exact: bool = False) -> torch.Tensor:
        """``numel`` uninitialised elements: the smallest kept buffer that fits (with ``exact``, only one of
        ``numel`` elements, so that nothing is held beyond it), else a new one."""
        fits = [i for i, b in enumerate(self.free) if b.dtype == dtype and b.device == device and
                (b.numel() == numel if exact else b.numel() >= numel)]
        if not fits:
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        return buf[:numel]

    def give(self, t: torch.Tensor) -> None:
        """Hand back a tensor from :meth:`take` (its whole buffer is kept, or freed past ``keep``)."""
        if self.keep <= 0:
            return
        base = t._base if t._base is not None else t
        self.free.append(base)
        self.free.sort(key=torch.Tensor.numel, reverse=True)
        del self.free[self.keep:]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.free)
