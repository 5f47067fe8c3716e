"""Cutting the model into keyed partitions and assigning them to servers by key range.

Every trainable tensor (in the single-process optimizer's order, :func:`shardwise.train.optim.
optimizer_param_names`) is flattened and cut into pieces of at most ``partition_bytes`` (BytePS cuts each
tensor into ``BYTEPS_PARTITION_BYTES`` = 4,096,000-byte pieces the same way; Jiang et al. OSDI 2020 §5).
The pieces are numbered 0, 1, ... (the *keys*) and the key space is cut into S contiguous ranges of about
equal bytes, one per server: ps-lite's range slicer (Li et al. OSDI 2014 §3.2, "key ranges"), which keeps a
server's keys contiguous so its partitions are one range of the model.

Each partition also carries a *priority*: the position of its tensor in the model's forward order
(embeddings first). ByteScheduler (Peng et al. SOSP 2019 §3) and P3 (Jayarajan et al. SysML 2019 §3) send
the layers nearest the input first, since the next forward pass needs them first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

FP32_BYTES = 4


@dataclass(frozen=True)
class Partition:
    """Elements ``[start, start + numel)`` of the flattened tensor ``name`` (optimizer index ``index``)."""

    key: int
    name: str
    index: int
    start: int
    numel: int
    shape: tuple[int, ...]
    decay: bool
    priority: int
    server: int

    @property
    def nbytes(self) -> int:
        return self.numel * FP32_BYTES


def cut(numel: int, piece: int) -> list[tuple[int, int]]:
    """``(start, length)`` pieces of at most ``piece`` elements covering ``[0, numel)`` exactly."""
    return [(s, min(piece, numel - s)) for s in range(0, numel, piece)] or [(0, 0)]


def key_ranges(sizes: list[int], n_servers: int) -> list[int]:
    """The server of each key: contiguous key ranges of about ``sum(sizes) / n_servers`` bytes each. The
    next range starts once the bytes before a key reach the current range's share (or when the keys left
    are just enough to give every remaining server one), so no server is empty while keys suffice."""
    total, owner, s, before = sum(sizes), [], 0, 0
    for i, size in enumerate(sizes):
        has_one = bool(owner) and owner[-1] == s
        if s < n_servers - 1 and has_one and (before * n_servers >= (s + 1) * total
                                              or len(sizes) - i <= n_servers - 1 - s):
            s += 1
        owner.append(s)
        before += size
    return owner


def partition_model(model: nn.Module, partition_bytes: int, n_servers: int) -> list[Partition]:
    """Every trainable tensor of ``model`` cut into partitions of at most ``partition_bytes`` (fp32), keyed
    in the optimizer's order and assigned to ``n_servers`` servers by key range."""
    from shardwise.train.optim import decay_groups

    decay, no_decay, params = decay_groups(model.named_parameters())
    forward = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    per_piece = max(1, partition_bytes // FP32_BYTES)
    raw = []
    for index, name in enumerate(decay + no_decay):
        p = params[name]
        for start, numel in cut(p.numel(), per_piece):
            raw.append((name, index, start, numel, tuple(p.shape), name in decay, forward[id(p)]))
    owners = key_ranges([r[3] * FP32_BYTES for r in raw], n_servers)
    return [Partition(key, *r, server=s) for key, (r, s) in enumerate(zip(raw, owners, strict=True))]


def forward_order(partitions: Iterable[Partition]) -> list[Partition]:
    """``partitions`` in the order the forward pass needs them (by priority, then key): the order in which a
    server sends a pull's reply and a worker posts its receives (point-to-point messages of one tag match
    in order), so the input's layers arrive first (P3, Jayarajan et al. SysML 2019 §3)."""
    return sorted(partitions, key=lambda q: (q.priority, q.key))


def check_cover(partitions: Iterable[Partition], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError unless the partitions cover every tensor of ``shapes`` exactly once."""
    seen: dict[str, int] = {}
    for part in sorted(partitions, key=lambda q: (q.name, q.start)):
        if part.start != seen.get(part.name, 0):
            expected = seen.get(part.name, 0)
            raise ValueError(f"partition {part.key} of {part.name} starts at {part.start}, expected {expected}")
        seen[part.name] = part.start + part.numel
    for name, shape in shapes.items():
        if seen.get(name) != math.prod(shape):
            raise ValueError(f"{name}: partitions cover {seen.get(name, 0)} of {math.prod(shape)} elements")
