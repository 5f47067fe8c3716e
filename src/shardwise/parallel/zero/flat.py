"""A flat, padded, evenly sharded group of parameters: the storage unit of every ZeRO stage.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20), §5: the parameters of a unit (a gradient bucket for ZeRO-1/2, a transformer
block for ZeRO-3) are laid end to end in one buffer, padded with zeros to a multiple of the
data-parallel size N, and rank ``r`` owns the ``r``-th of N equal slices. Equal slices are what
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` need (gloo cannot gather unequal sizes).

Each model parameter becomes a view into the unit's full buffer (``param.data = full[a:b]``),
so gathering the full buffer refills every parameter at once, and freeing it (resizing its
storage to zero bytes, as FSDP does) frees them all while the parameters keep their shapes.

A parameter may arrive on the meta device (a model built under ``torch.device("meta")``): its
values then come from ``init(name, param)``, the full initial value of that one parameter, of
which the unit keeps what it needs -- the rank's pieces for ZeRO-3 -- before asking for the next
(as FSDP2's meta-device initialisation, Zhao et al. 2023 §3.1, but one parameter at a time, so a
model larger than one rank's memory starts with one parameter's full value as the most extra).
The meta parameter object is turned into a real one in place (``torch.utils.swap_tensors``), so
tied weights and references held elsewhere stay the same parameter.

The *pieces* of a unit on a rank are the intersections of its parameters with the rank's
slice. They are what the optimizer sees: one leaf tensor per piece, so a parameter's weight
decay group and AdamW's element-wise arithmetic are exactly those of the unsharded run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(eq=False)
class Piece:
    """The part ``[start, stop)`` of parameter ``param_index`` of a unit that this rank owns."""

    param_index: int
    start: int
    """Offset into the flattened parameter."""
    stop: int
    shard_offset: int
    """Where the piece begins inside this rank's shard."""

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FlatUnit:
    """One flat-sharded group of parameters.

    Args:
        names: the parameters' qualified names (for checkpoints and error messages).
        params: the parameters, deduplicated (a tied weight appears once).
        rank, world: this rank's position in, and the size of, ``group``.
        group: the group the unit's slices are spread over (the engine's data-parallel group, or for
            expert weights under expert parallelism the ranks holding the same experts).
        dtype: dtype of the flat parameter buffer (the compute copy's dtype).
        sharded: ZeRO-3: build only ``shard`` (this rank's slice) from the parameters and leave
            the full buffer unallocated, so sharding a model never holds a second full copy of a unit.
    """

    def __init__(self, index: int, names: list[str], params: list[nn.Parameter], rank: int, world: int,
                 dtype: torch.dtype | None = None, sharded: bool = False,
                 init: Callable[[str, nn.Parameter], torch.Tensor] | None = None, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        self.index = index
        self.group = group
        self.names = names
        self.params = params
        self.rank, self.world = rank, world
        self.dtype = dtype or params[0].dtype
        device = torch.device(device) if device is not None else params[0].device
        if device.type == "meta":
            raise ValueError("FlatUnit: parameters on the meta device need a real ``device`` to materialise on")
        if init is None and any(p.is_meta for p in params):
            raise ValueError(f"FlatUnit: {names[0]} is on the meta device; pass ``init`` to compute its values")
        self.init = init
        self.checksums: dict[int, int] = {}
        """Per parameter index: :func:`checksum` of the full initial value computed here (meta parameters)."""
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world)
        self.padded_numel = self.shard_numel * world
        lo = rank * self.shard_numel
        self.pieces: list[Piece] = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(off, lo), min(off + n, lo + self.shard_numel)
            if a < b:
                self.pieces.append(Piece(i, a - off, b - off, a - lo))
        with torch.no_grad():
            if sharded:  # ZeRO-3: keep only the own slice; the full buffer is never filled here
                self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=device)
                for pc in self.pieces:
                    src = self._values(pc.param_index)[pc.start:pc.stop]
                    self.shard[pc.shard_offset:pc.shard_offset + pc.numel].copy_(src)
                self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=device)
            else:
                self.full = torch.zeros(self.padded_numel, dtype=self.dtype, device=device)
                for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
                    self.full[off:off + n].copy_(self._values(i))
                self.shard = self.own_slice(self.full)
            for p, off, n in zip(params, self.offsets, self.numels, strict=True):
                shape = p.shape
                if p.is_meta:  # the same Parameter object, now real (tied weights stay tied)
                    real = nn.Parameter(torch.empty(0, dtype=self.dtype, device=device), requires_grad=p.requires_grad)
                    torch.utils.swap_tensors(p, real)
                # as ``.data``: the parameter keeps its own version counter, so refilling ``full`` in place
                # (gathers) does not look to autograd like a change to a tensor it saved
                p.data = self.full[off:off + n].view(shape)
        self.gathered = True
        self.gather_work = None
        self.after_gather = None
        """ZeRO-3: what to do once the pending gather completes (e.g. keep a secondary partition)."""
        self.grad_flat: torch.Tensor | None = None
        """ZeRO-2/3: this backward's gradients, laid out like ``full`` (:meth:`grad_view`), until reduced."""
        self.grad_filled: list[bool] = []
        self.secondary: torch.Tensor | None = None
        self.had_grad = [True] * len(params)
        """Per parameter: did any rank produce a gradient in the last step (set by the engine)."""
        """ZeRO++ hpZ: this rank's node slice of the gathered buffer, from forward to backward."""
        if sharded:
            self.free_full()

    def _values(self, i: int) -> torch.Tensor:
        """Parameter ``i`` flattened: its data, or (on the meta device) its full initial value from ``init``."""
        p = self.params[i]
        if not p.is_meta:
            return p.detach().reshape(-1)
        value = self.init(self.names[i], p).detach()
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"init({self.names[i]!r}) returned shape {tuple(value.shape)}, expected {tuple(p.shape)}")
        self.checksums[i] = checksum(value)
        return value.reshape(-1)

    # ---- the rank's slice -----------------------------------------------------------------

    def own_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's ``shard_numel`` elements of a padded flat buffer."""
        return flat[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]

    # ---- the flat gradient of one backward (ZeRO-2/3) ------------------------------------------

    def grad_view(self, i: int, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """Parameter ``i``'s place in this backward's flat gradient buffer, which ``alloc(numel)`` provides
        (uninitialised) on first use; the caller fills the place."""
        if self.grad_flat is None:
            self.grad_flat = alloc(self.padded_numel)
            self.grad_filled = [False] * len(self.params)
        self.grad_filled[i] = True
        return self.grad_flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.params[i].shape)

    def take_flat_grad(self, divide_by: int, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The parameters' gradients laid out like ``full``, divided by ``divide_by`` (zeros for padding
        and parameters without a gradient); the parameters' ``.grad`` are released."""
        if self.grad_flat is None:
            self.grad_flat = alloc(self.padded_numel)
            self.grad_filled = [False] * len(self.params)
        flat = self.grad_flat
        for i, (p, off, n) in enumerate(zip(self.params, self.offsets, self.numels, strict=True)):
            if not self.grad_filled[i]:  # not accumulated into the buffer (e.g. only in earlier micro-batches)
                if p.grad is not None:
                    flat[off:off + n].copy_(p.grad.reshape(-1))
                else:
                    flat[off:off + n].zero_()
            p.grad = None
        flat[self.numel:].zero_()
        flat.div_(divide_by)
        self.grad_flat, self.grad_filled = None, []
        return flat

    # ---- freeing and refilling the full buffer (ZeRO-3) ----------------------------------------

    def free_full(self) -> None:
        """Release the full buffer's memory; parameters keep their shapes but hold no data."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def alloc_full(self) -> None:
        if not self.gathered and self.gather_work is None:
            self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())

    def param_bytes_full(self) -> int:
        return self.padded_numel * self.full.element_size()



def checksum(t: torch.Tensor) -> int:
    """An order-independent, bit-exact fingerprint of ``t``'s values: the sum of its elements' bit
    patterns as integers (mod 2^62), summed a chunk at a time so that only a chunk is widened."""
    flat = t.detach().reshape(-1).contiguous()
    bits = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16}.get(flat.element_size(), torch.uint8))
    total = 0
    for chunk in bits.split(1 << 16):
        total += int(chunk.sum(dtype=torch.int64))
    return total % (1 << 62)
