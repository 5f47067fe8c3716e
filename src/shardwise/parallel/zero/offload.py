"""Where a rank's fp32 master pieces live: in its shard, in CPU memory, or in memory-mapped files.

* ``"none"`` with fp32 parameters: a master piece is a *view* of the rank's slice of the flat
  parameter buffer — the parameters are already the fp32 truth, so no second copy exists.
* ``"none"`` with low-precision flat parameters (``param_dtype``): separate fp32 pieces on the
  parameters' device (the mixed-precision layout of Rajbhandari et al. 2020, §3.1 / Micikevicius
  et al. 2018).
* ``"cpu"``: ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
  Training", §4): fp32 master pieces and the optimizer step on CPU; gradient slices are copied
  to CPU after the reduce-scatter, updated pieces copied back into the (device) shard.
* ``"disk"``: ZeRO-Infinity style (Rajbhandari et al. 2021, "ZeRO-Infinity", §5): master pieces
  and Adam moments are tensors backed by memory-mapped files under ``offload_dir`` (one file
  per rank and tensor kind), paged in and out by the operating system as the step touches them.
  This is the simple form of the idea: no explicit prefetching of the next piece.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

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
        self._files: list[torch.Tensor] = []
        self._dir = Path(offload_dir) / f"rank{rank}" if offload == "disk" else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
        self.entries = []  # (unit, piece, master)
        for u in units:
            for pc in u.pieces:
                src = u.shard[pc.shard_offset:pc.shard_offset + pc.numel]
                if not self.separate:
                    m = src.detach()
                elif offload == "disk":
                    m = self.mapped(f"master_u{u.index}_p{pc.param_index}", pc.numel)
                    m.copy_(src.detach().float())
                else:
                    device = torch.device("cpu") if offload == "cpu" else src.device
                    m = src.detach().to(device=device, dtype=torch.float32, copy=True)
                self.entries.append((u, pc, m))

    def mapped(self, name: str, numel: int) -> torch.Tensor:
        """A zeroed fp32 tensor of ``numel`` elements backed by the file ``offload_dir/rankR/name``."""
        path = self._dir / f"{name}.bin"
        if path.exists():
            os.remove(path)
        t = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)
        t.zero_()
        return t

    def params(self) -> list[torch.Tensor]:
        return [m for _, _, m in self.entries]

    def set_grads(self, units) -> None:
        """Point (or copy) each master piece's ``.grad`` at its slice of the reduced gradient shard."""
        for u, pc, m in self.entries:
            g = u.grad_shard[pc.shard_offset:pc.shard_offset + pc.numel]
            m.grad = g.to(device=m.device, dtype=torch.float32, copy=True) if self.separate else g

    def zero_grad(self) -> None:
        for _, _, m in self.entries:
            m.grad = None

    @torch.no_grad()
    def write_back(self, units) -> None:
        """Copy updated separate master pieces into the shards (casting to the flat dtype)."""
        if not self.separate:
            return
        for u, pc, m in self.entries:
            u.shard[pc.shard_offset:pc.shard_offset + pc.numel].copy_(m)

    def nbytes(self) -> int:
        """Bytes of master weights held apart from the parameters (0 when they are views)."""
        return sum(m.numel() * m.element_size() for m in self.params()) if self.separate else 0
