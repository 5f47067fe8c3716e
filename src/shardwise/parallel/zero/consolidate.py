"""The layout-independent ("consolidated") model state of a ZeRO run: gathered from the shards, sliced back.

:func:`full_model_state` returns the plain model's ``state_dict()`` (fp32 master values) on every rank, a
collective; :func:`load_full_model_state` cuts such a state dict to this rank's shards, master pieces and
buffers, so a checkpoint resumes on any number of data-parallel ranks or ZeRO stage. The optimizer's
consolidated state (:class:`~shardwise.parallel.zero.optim.ZeroOptimizer`) uses the same gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from shardwise.parallel.zero.wrapper import ZeroDataParallel


def gather_flat(engine: ZeroDataParallel, unit, values: dict[int, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """All-gather a unit-shaped flat tensor whose rank slices are given piece by piece
    (``values[param_index]`` for this rank's pieces of ``unit``)."""
    shard = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.shard.device)
    for pc in unit.pieces:
        if pc.param_index in values:
            shard[pc.shard_offset:pc.shard_offset + pc.numel].copy_(values[pc.param_index].reshape(-1))
    if unit.world == 1:
        return shard
    full = torch.empty(unit.padded_numel, dtype=dtype, device=shard.device)
    dist.all_gather_single(full, shard, group=unit.group)
    return full


def master_of(engine: ZeroDataParallel) -> dict[tuple[int, int], torch.Tensor]:
    return {(u.index, pc.param_index): m for u, pc, m in engine.masters.entries}


@torch.no_grad()
def full_model_state(engine: ZeroDataParallel) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict()`` (fp32 master values), on every rank. A collective."""
    masters = master_of(engine)
    by_param: dict[int, torch.Tensor] = {}
    for u in engine.units:
        with engine.masters.resident(u):
            values = {pc.param_index: masters[(u.index, pc.param_index)] for pc in u.pieces}
            full = gather_flat(engine, u, values).cpu()
        for p, off, n in zip(u.params, u.offsets, u.numels, strict=True):
            by_param[id(p)] = full[off:off + n].view(p.shape).clone()  # fp32 masters, whatever p.dtype is
    out = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        out[name] = by_param[id(t)] if id(t) in by_param else t.detach().cpu().clone()
    return out


@torch.no_grad()
def load_full_model_state(engine: ZeroDataParallel, state: dict[str, torch.Tensor]) -> tuple[list, list]:
    """Load an unsharded state dict into the shards, master pieces and buffers; returns (missing, unexpected)."""
    live = engine.module.state_dict(keep_vars=True)
    missing = [k for k in live if k not in state]
    unexpected = [k for k in state if k not in live]
    if missing or unexpected:
        return missing, unexpected
    name_of = {}
    for name, t in live.items():
        name_of.setdefault(id(t), name)
    masters = master_of(engine)
    for u in engine.units:
        if engine.stage == 3 and not u.gathered:  # only this rank's slice is kept: read only its pieces
            flat = None
            own = u.shard if u.shard.dtype == torch.float32 else torch.empty(u.shard_numel, dtype=torch.float32)
            _read_own_slice(u, own, state, name_of)  # fp32 shards: straight into the shard (masters copy it)
            if own is not u.shard:
                u.shard.copy_(own)
        else:
            flat = torch.zeros(u.padded_numel, dtype=torch.float32)
            for p, off, n in zip(u.params, u.offsets, u.numels, strict=True):
                flat[off:off + n].copy_(state[name_of[id(p)]].reshape(-1))
            own = u.own_slice(flat).to(u.shard.device)
            u.shard.copy_(own)
        engine.hpz.drop(u)
        if engine.stage < 3 or u.gathered:
            u.full.copy_(flat.to(u.full.device))
        with engine.masters.resident(u, write=True):
            for pc in u.pieces:
                m = masters[(u.index, pc.param_index)]
                if engine.masters.separate:
                    m.copy_(own[pc.shard_offset:pc.shard_offset + pc.numel])
    params = {id(p) for u in engine.units for p in u.params}
    for name, t in live.items():
        if id(t) not in params:
            t.data.copy_(state[name])
    return [], []


def _read_own_slice(unit, own: torch.Tensor, state, name_of: dict[int, str]) -> None:
    """Fill ``own`` (this rank's slice of ``unit``, fp32) from the state's tensors, piece by piece (``read_slice``
    of a lazy state -- a checkpoint's, a transformers directory's -- reads only those elements); padding zero."""
    own.zero_()
    for pc in unit.pieces:
        name = name_of[id(unit.params[pc.param_index])]
        if hasattr(state, "read_slice"):
            values = state.read_slice(name, pc.start, pc.stop)
        else:
            values = state[name].reshape(-1)[pc.start:pc.stop]
        own[pc.shard_offset:pc.shard_offset + pc.numel].copy_(values)
        del values
