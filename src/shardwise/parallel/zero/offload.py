"""Where a rank's fp32 master pieces live: in its shard, in CPU memory, or in memory-mapped files.

* ``"none"`` with fp32 parameters: a master piece is a *view* of the rank's slice of the flat
  parameter buffer — the parameters are already the fp32 truth, so no second copy exists.
* ``"none"`` with low-precision flat parameters (``param_dtype``): separate fp32 pieces on the
  parameters' device (the mixed-precision layout of Rajbhandari et al. 2020, §3.1 / Micikevicius
  et al. 2018).
* ``"cpu"``: ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
  Training", §4): fp32 master pieces and the optimizer step on CPU; each unit's gradient slice
  is copied to CPU as soon as its reduce-scatter has finished, while backward goes on (§4.2: on a
  GPU into pinned memory with a non-blocking copy on a side stream, so the transfer overlaps the
  remaining backward); updated pieces are copied back into the (device) shard -- on a GPU the
  masters are pinned too and the copy back is non-blocking on the same side stream, which the
  compute stream waits for before the next forward.
* ``"disk"``: ZeRO-Infinity style (Rajbhandari et al. 2021, "ZeRO-Infinity", §5): master pieces
  and optimizer states live in files under ``offload_dir`` and are streamed in and out one unit
  at a time by the optimizer step (:mod:`.disk`); gradients reach CPU as with ``"cpu"``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from shardwise.parallel.zero.disk import DiskStream

OFFLOADS = ("none", "cpu", "disk")


class MasterStore:
    """The master pieces of one rank, in the order units → pieces, and how gradients reach them."""

    def __init__(self, units, offload: str = "none", offload_dir: str | None = None, rank: int = 0):
        if offload not in OFFLOADS:
            raise ValueError(f"offload={offload!r}; use one of {OFFLOADS}")
        if offload == "disk" and not offload_dir:
            raise ValueError("offload='disk' needs offload_dir")
        self.offload = offload
        self.separate = offload != "none" or any(u.dtype != torch.float32 for u in units)
        self.entries = []  # (unit, piece, master)
        for u in units:
            for pc in u.pieces:
                src = u.shard[pc.shard_offset:pc.shard_offset + pc.numel]
                if not self.separate:
                    m = src.detach()
                elif offload == "disk":  # hollow until streamed in (DiskStream)
                    m = torch.empty(0, dtype=torch.float32)
                elif offload == "cpu" and src.is_cuda:  # pinned, so the write-back can be asynchronous
                    m = torch.empty(pc.numel, dtype=torch.float32, pin_memory=True)
                    m.copy_(src.detach())
                else:
                    device = torch.device("cpu") if offload == "cpu" else src.device
                    m = src.detach().to(device=device, dtype=torch.float32, copy=True)
                self.entries.append((u, pc, m))
        self.disk = DiskStream(self.entries, Path(offload_dir) / f"rank{rank}") if offload == "disk" else None
        # offload: each unit's gradient slice lands in a CPU buffer (pinned when the shards are on a GPU)
        self._grad_cpu: dict[int, torch.Tensor] = {}
        self._copy_stream = None
        if offload != "none":
            pin = units[0].shard.is_cuda
            for u in units:
                self._grad_cpu[u.index] = torch.empty(u.shard_numel, dtype=torch.float32, pin_memory=pin)
            if pin:
                self._copy_stream = torch.cuda.Stream(device=units[0].shard.device)

    def params(self) -> list[torch.Tensor]:
        return [m for _, _, m in self.entries]

    def grad_buffers(self) -> list[torch.Tensor]:
        """The CPU buffers offloaded gradient shards land in (none without offload)."""
        return list(self._grad_cpu.values())

    def resident(self, unit, state: dict | None = None, write: bool = False):
        """Context in which ``unit``'s master pieces (and optimizer ``state``) hold values: a no-op
        unless offload is "disk", where they are streamed in and, with ``write``, back out."""
        if self.disk is None:
            return contextlib.nullcontext()
        return self.disk.resident(unit.index, state, write)

    @torch.no_grad()
    def grad_ready(self, unit) -> None:
        """``unit.grad_shard`` is final (its reduce-scatter finished): with offload, start copying
        it to the CPU buffer now, during backward. On CUDA the copy is non-blocking on a side
        stream into pinned memory; :meth:`set_grads` waits for it."""
        if not self._grad_cpu:
            return
        src, dst = unit.grad_shard, self._grad_cpu[unit.index]
        if self._copy_stream is None:
            dst.copy_(src)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self._copy_stream)

    def set_grads(self, units) -> None:
        """Point (or copy) each master piece's ``.grad`` at its slice of the reduced gradient shard
        (``None`` for a parameter that received no gradient on any rank: ``unit.had_grad``)."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        for u, pc, m in self.entries:
            sl = slice(pc.shard_offset, pc.shard_offset + pc.numel)
            if not u.had_grad[pc.param_index]:  # no rank produced one: the optimizer skips it
                m.grad = None
            elif self._grad_cpu:
                m.grad = self._grad_cpu[u.index][sl]
            elif self.separate:
                m.grad = u.grad_shard[sl].to(dtype=torch.float32, copy=True)
            else:
                m.grad = u.grad_shard[sl]

    def zero_grad(self) -> None:
        for _, _, m in self.entries:
            m.grad = None

    @torch.no_grad()
    def write_back(self, units) -> None:
        """Copy updated separate master pieces into the shards (casting to the flat dtype); with
        disk offload the streamed step has done so unit by unit."""
        if not self.separate or self.disk is not None:
            return
        stream = self._copy_stream
        if stream is None:
            for u, pc, m in self.entries:
                u.shard[pc.shard_offset:pc.shard_offset + pc.numel].copy_(m)
            return
        # CPU offload on a GPU: non-blocking copies from the pinned masters on the side stream, after
        # whatever the compute stream still does with the shards; the compute stream waits for them
        compute = torch.cuda.current_stream(stream.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            for u, pc, m in self.entries:
                u.shard[pc.shard_offset:pc.shard_offset + pc.numel].copy_(m, non_blocking=True)
        compute.wait_stream(stream)

    def nbytes(self) -> int:
        """Bytes of master weights held apart from the parameters (0 when they are views)."""
        return sum(pc.numel * 4 for _, pc, _ in self.entries) if self.separate else 0
