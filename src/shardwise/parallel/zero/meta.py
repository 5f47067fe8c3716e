"""Starting ZeRO from a model built on the meta device: nothing full-size is ever allocated.

The usual start -- build the whole model on every rank, broadcast rank 0's weights, keep a shard --
needs the full fp32 model in each rank's memory for a moment, which is exactly what ZeRO-3 exists
to avoid (Rajbhandari et al. 2020, §5.3; FSDP2's meta-device initialisation, Zhao et al. 2023, §3.1,
is the same remedy). With a model built under ``torch.device("meta")`` and an ``init(name, param)``
that computes a parameter's initial value from what is known everywhere (shardwise's models:
``(seed, name, shape)``, see :func:`shardwise.model.transformer.initial_value`), each rank
materialises only what it keeps (:class:`.flat.FlatUnit`), and no broadcast is needed: every rank
computes the same values. :func:`check_ranks_agree` makes sure they did, cheaply.

Buffers (e.g. rotary tables) are small and not sharded: :func:`materialize_buffers` allocates them
and the model's own initialisation fills them.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

_ABSENT = -(1 << 62)
"""A checksum slot a rank did not compute (below every real checksum, which are in [0, 2^62))."""


def materialize_buffers(module: nn.Module, device: torch.device | str) -> None:
    """Give every buffer of ``module`` that is on the meta device uninitialised memory on ``device``
    (parameters stay on the meta device); the model's own initialisation must then fill them."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)


def structure_hash(named: list[tuple[str, nn.Parameter]]) -> int:
    """crc32 of the parameters' names, shapes, dtypes and whether each is on the meta device."""
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{int(p.is_meta)}" for n, p in named)
    return zlib.crc32(text.encode())


def check_ranks_agree(units, structure: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise on every rank if the ranks built different models, or computed different initial values.

    One all-reduce (MAX) of ``2 + 2P`` integers: the structure hash and its negation, then per
    parameter the checksum of its full initial value (:func:`.flat.checksum`) and its negation, from
    every rank that computed one (a rank computes the parameters its slice touches, so those that
    straddle two ranks' slices are compared; a different seed shows there). Max = -max(-x) = min,
    so equal pairs mean every rank that reports a value reports the same.
    """
    sums = [s for u in units for s in ([u.checksums.get(i, _ABSENT) for i in range(len(u.params))])]
    names = [n for u in units for n in u.names]
    mine = [structure, -structure] + [v for s in sums for v in (s, -s if s != _ABSENT else _ABSENT)]
    agreed = torch.tensor(mine, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    agreed = agreed.tolist()
    if agreed[0] != -agreed[1]:
        raise ValueError("ZeroDataParallel: the ranks built different models (parameter names, shapes or "
                         "dtypes differ between ranks)")
    for i, name in enumerate(names):
        hi, neg_lo = agreed[2 + 2 * i], agreed[3 + 2 * i]
        if hi != _ABSENT and hi != -neg_lo:
            raise ValueError(f"ZeroDataParallel: the ranks computed different initial values for {name!r} "
                             "(a different seed or initialisation on some rank?)")
