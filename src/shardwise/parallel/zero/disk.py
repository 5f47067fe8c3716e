"""Disk offload streamed unit by unit (ZeRO-Infinity style).

Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep
Learning" (SC'21), §5 and §6.2: the fp32 master weights and the optimizer states live on NVMe;
the optimizer step brings in one partition at a time, updates it, and writes it back, so the CPU
memory they need is one partition's, not the model's.

Here one partition is one unit's slice on this rank. Each unit has one file per kind of state
under ``offload_dir/rankR``: ``master_u{i}.bin`` and one per element-wise optimizer state (e.g.
``exp_avg_u{i}.bin``, ``exp_avg_sq_u{i}.bin``), each ``shard_numel`` fp32 values laid out like
the rank's shard. Files are read and written explicitly (``readinto`` / ``write``), not mapped, so
what is resident is exactly what :meth:`DiskStream.resident` has loaded.

At rest, a master piece (and each of its optimizer-state tensors) is a *hollow* tensor: a
stride-0 expansion of one shared zero, with the right shape, dtype and device (so ``.grad`` can be
assigned to it) but no storage of its own; an accidental in-place write to it fails loudly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


class DiskStream:
    """The on-disk master pieces and optimizer states of one rank, loaded one unit at a time.

    Args:
        entries: ``(unit, piece, master)`` triples of the rank (see :class:`.offload.MasterStore`).
        directory: this rank's directory (created).
    """

    def __init__(self, entries, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._zero = torch.zeros(1, dtype=torch.float32)
        self.by_unit: dict[int, list] = {}
        self.units = {}
        for u, pc, m in entries:
            self.by_unit.setdefault(u.index, []).append((pc, m))
            self.units[u.index] = u
        self.state_kinds: dict[int, list[str]] = {i: [] for i in self.by_unit}
        """Per unit, the optimizer-state keys that have files (known once the first step made them)."""
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        """Most bytes of master weights and optimizer state resident at once (reset by the caller)."""
        for i, u in self.units.items():
            self._write(self._path("master", i), u.shard.detach().float().cpu(), 0, truncate=True)
            for pc, m in self.by_unit[i]:
                m.data = self.hollow(pc.numel)

    def hollow(self, numel: int) -> torch.Tensor:
        return self._zero.expand(numel)

    def file_bytes(self) -> dict[str, int]:
        """Bytes of this rank's state files on disk, by kind ("master", then the optimizer's keys)."""
        out: dict[str, int] = {}
        for path in self.dir.glob("*_u*.bin"):
            kind = path.name.rsplit("_u", 1)[0]
            out[kind] = out.get(kind, 0) + path.stat().st_size
        return out

    def _path(self, kind: str, unit_index: int) -> Path:
        return self.dir / f"{kind}_u{unit_index}.bin"

    @staticmethod
    def _write(path: Path, values: torch.Tensor, offset: int, truncate: bool = False) -> None:
        with open(path, "wb" if truncate or not path.exists() else "r+b") as f:
            f.seek(offset * 4)
            f.write(values.detach().contiguous().numpy().tobytes())

    @staticmethod
    def _read(path: Path, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        with open(path, "rb") as f:
            f.readinto(out.numpy())
        return out

    @contextlib.contextmanager
    def resident(self, unit_index: int, state: dict | None = None, write: bool = False) -> Iterator[None]:
        """Within the block, the unit's master pieces (and, with ``state`` — the optimizer's state
        dict — their optimizer states) hold their values, read from disk. On exit, with ``write``,
        they (and any element-wise optimizer state the block created) are written back and the
        unit's shard is refreshed from the masters; then everything is hollow again."""
        if unit_index not in self.by_unit:
            yield
            return
        u, pieces = self.units[unit_index], self.by_unit[unit_index]
        buffers = {"master": self._read(self._path("master", unit_index), u.shard_numel)}
        if state is not None:
            for kind in self.state_kinds[unit_index]:
                buffers[kind] = self._read(self._path(kind, unit_index), u.shard_numel)
        for pc, m in pieces:
            sl = slice(pc.shard_offset, pc.shard_offset + pc.numel)
            m.data = buffers["master"][sl]
            if state is not None and m in state:
                for kind in self.state_kinds[unit_index]:
                    state[m][kind] = buffers[kind][sl]
        self._count(sum(b.numel() * 4 for b in buffers.values()))
        try:
            yield
            if write:
                self._store(unit_index, state)
        finally:
            for pc, m in pieces:
                m.data = self.hollow(pc.numel)
                if state is not None and m in state:
                    for kind, v in state[m].items():
                        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == pc.numel:
                            state[m][kind] = self.hollow(pc.numel)
            self.resident_bytes = 0

    def _count(self, nbytes: int) -> None:
        self.resident_bytes = nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, nbytes)

    @torch.no_grad()
    def _store(self, unit_index: int, state: dict | None) -> None:
        u, pieces = self.units[unit_index], self.by_unit[unit_index]
        state_bytes = 0
        for pc, m in pieces:
            self._write(self._path("master", unit_index), m.data, pc.shard_offset)
            u.shard[pc.shard_offset:pc.shard_offset + pc.numel].copy_(m.data)
            if state is None or m not in state:
                continue
            for kind, v in state[m].items():
                if not (isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == pc.numel):
                    continue
                if kind not in self.state_kinds[unit_index]:  # first step: the optimizer made it
                    self.state_kinds[unit_index].append(kind)
                    self._write(self._path(kind, unit_index), torch.zeros(u.shard_numel), 0, truncate=True)
                state_bytes += v.numel() * 4
                self._write(self._path(kind, unit_index), v, pc.shard_offset)
        self._count(max(self.resident_bytes, u.shard_numel * 4 + state_bytes))
