"""The single-process training state of a tensor-parallel model part: checkpoint pieces, loading, norms.

Every parameter of a model rewritten by :func:`shardwise.parallel.tensor.plan.apply_tensor_parallel` carries a
:class:`~shardwise.parallel.tensor.layers.TPShard` (``p.tp_shard``): which rows of which dim of the full tensor
it holds, and whether this rank is the *owner* among the ranks holding the same piece. From that alone:

* a checkpoint holds the single-process state (layout-free, :mod:`shardwise.train.sharded`): each owner
  writes its rows of every parameter and of its optimizer moments as flat pieces of the full tensor (one
  piece for a split along dim 0; one per leading index for a split along a later dim);
* loading takes this rank's rows of each full tensor (``TPShard.take``), padding included, so a tensor-
  parallel run resumes from any layout's checkpoint and the other way round;
* the global gradient norm reads the same metadata (:mod:`shardwise.parallel.grad_norm`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from shardwise.train.sharded import Piece


def shard_info(t: torch.Tensor):
    """The tensor's :class:`TPShard` over ep (``p.ep_shard``, an expert-parallel shard,
    :mod:`shardwise.parallel.expert.dispatch`; whole on every tp rank, tp rank 0 its owner) or over tp
    (``p.tp_shard``), or ``None`` for a tensor that is whole on this rank."""
    info = getattr(t, "ep_shard", None)
    return getattr(t, "tp_shard", None) if info is None else info


def slice_pieces(key: str, local: torch.Tensor, info) -> list[Piece]:
    """Flat pieces of the full tensor ``key`` that ``local`` (this rank's part, laid out as ``info``) holds."""
    full_shape = tuple(info.full_shape)
    if info.dim is None:
        return [Piece(key, local.detach().reshape(-1), 0, full_shape)]
    d = info.dim
    real = local.detach()[info.local_index()]
    inner = math.prod(full_shape[d + 1:])
    rows = info.real_rows
    if rows == 0:
        return []
    runs = real.reshape(-1, rows * inner)
    return [Piece(key, runs[i], info.run_start(i), full_shape) for i in range(runs.shape[0])]


def owned_param_names(module: nn.Module) -> dict[str, object]:
    """Every state-dict key of ``module`` that names a parameter, with its TPShard (``None`` when the
    parameter is not laid out over tp); tied parameters appear under every name."""
    return {name: shard_info(p) for name, p in module.named_parameters(remove_duplicate=False)}


def model_pieces(module: nn.Module, tp_rank: int, state: Mapping[str, torch.Tensor] | None = None) -> list[Piece]:
    """This rank's pieces of the single-process model state: owned slices of parameters; buffers and
    parameters without tp metadata from tensor-parallel rank 0. ``state``: the module's local state dict
    when it is not ``module.state_dict()`` (a ZeRO wrapper's gathered one)."""
    infos = owned_param_names(module)
    pieces: list[Piece] = []
    for key, t in (module.state_dict() if state is None else state).items():
        info = infos.get(key)
        if info is None:
            if tp_rank == 0:
                pieces.append(Piece(f"model/{key}", t.detach().reshape(-1), 0, tuple(t.shape)))
        elif info.owner:
            pieces += slice_pieces(f"model/{key}", t, info)
    return pieces


def optimizer_pieces(params: list[nn.Parameter], state: Mapping[int, Mapping], tp_rank: int) -> list[Piece]:
    """Pieces of the optimizer's per-parameter state (``state[i]`` belongs to ``params[i]``, the
    single-process optimizer's index order): element-wise moments sliced like their parameter,
    scalars (the step count) written once."""
    pieces: list[Piece] = []
    for index, per_param in state.items():
        p = params[index]
        info = shard_info(p)
        owner = info.owner if info is not None else tp_rank == 0
        if not owner:
            continue
        for name, value in per_param.items():
            key = f"optim/{index}/{name}"
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {index}/{name} is a {type(value).__name__}; only tensors are saved")
            if info is not None and value.dim() > 0 and value.shape == p.shape:
                pieces += slice_pieces(key, value, info)
            else:
                pieces.append(Piece(key, value.detach().reshape(-1), 0, tuple(value.shape)))
    return pieces


def local_value(full: torch.Tensor, like: torch.Tensor, info) -> torch.Tensor:
    """This rank's part of ``full`` for a local tensor shaped like ``like`` (padding zero)."""
    if info is None:
        return full
    return info.take(full, like.shape[info.dim] if info.dim is not None else None)


def read_local(state: Mapping, key: str, like: torch.Tensor, info) -> torch.Tensor:
    """This rank's part of ``state[key]`` for a local tensor shaped like ``like``: a lazy state that can read rows
    (``read_rows``: a checkpoint's, a transformers directory's) reads only this rank's rows, else the whole
    tensor is read and cut."""
    if info is None or info.dim is None or not hasattr(state, "read_rows") or \
            state.ndim(key) != len(info.full_shape):
        return local_value(state[key], like, info)
    if hasattr(info, "split"):  # experts of a tensor-parallel split: read their rows, then cut the split
        return info.split.take(state.read_rows(key, 0, info.start, info.stop), like.shape[info.dim])
    rows = state.read_rows(key, info.dim, info.start, info.stop)
    if rows.shape[info.dim] == like.shape[info.dim]:
        return rows
    out = rows.new_zeros(like.shape)
    out[info.local_index()] = rows
    return out


@torch.no_grad()
def load_model(module: nn.Module, model_state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's part of every tensor of the single-process ``model_state`` into ``module``."""
    from shardwise.train.checkpoint import CheckpointError

    infos = owned_param_names(module)
    own = module.state_dict()
    missing = [k for k in own if k not in model_state]
    if missing:
        raise CheckpointError(f"checkpoint model does not match: missing {missing[:3]}")
    for key, local in own.items():
        local.copy_(read_local(model_state, key, local, infos.get(key)))


def local_optimizer_state(params: list[nn.Parameter], state: Mapping[int, Mapping]) -> dict[int, dict]:
    """The single-process optimizer state (full tensors per index) cut to this rank's parameters."""
    return {int(i): dict(LocalView.of_tensor(per_param, params[int(i)])) for i, per_param in state.items()}


def gather_full_state(modules: nn.Module | list[nn.Module], tp_rank: int, active: bool = True,
                      dst: int = 0, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The whole single-process model state on global rank ``dst`` from every rank's ``modules`` (a model
    part, or a pipeline rank's stages; ``state``: the one module's local state dict, if not its own); a
    collective over the world; ranks with ``active=False``, e.g. data-parallel replicas, contribute
    nothing. For tests and tools."""
    modules = modules if isinstance(modules, list) else [modules]
    return gather_pieces([p for m in modules for p in model_pieces(m, tp_rank, state)] if active else [], dst)


def gather_pieces(pieces: list[Piece], dst: int = 0) -> dict[str, torch.Tensor]:
    """The whole tensors on global rank ``dst`` from every rank's ``model/...`` pieces (a collective over the world)."""
    mine = [(p.key, p.start, p.values.cpu(), p.shape) for p in pieces]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, out, dst=dst)
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in out or []:
        for key, start, values, shape in rank_pieces:
            name = key.removeprefix("model/")
            t = full.setdefault(name, torch.zeros(math.prod(shape), dtype=values.dtype))
            t[start:start + values.numel()] = values
            full[name] = t
    shapes = {p[0].removeprefix("model/"): p[3] for rp in (out or []) for p in rp}
    return {k: v.view(shapes[k]) for k, v in full.items()}


def local_range_pieces(key: str, values: torch.Tensor, local_start: int, local_shape: tuple[int, ...],
                       info) -> list[Piece]:
    """Pieces of the full tensor ``key`` for elements ``[local_start, local_start + values.numel())`` of this
    rank's flattened local tensor (a ZeRO shard's slice of a tensor-parallel piece): split where the
    local rows stop being contiguous in the full tensor, padding rows left out; none for a non-owner."""
    full_shape = tuple(info.full_shape)
    if not info.owner:
        return []
    if info.dim is None:
        return [Piece(key, values, local_start, full_shape)]
    d = info.dim
    inner = math.prod(local_shape[d + 1:])
    block = local_shape[d] * inner  # one leading index's rows, padding included
    real = info.real_rows * inner
    out, pos, end = [], local_start, local_start + values.numel()
    while pos < end:
        lead, off = divmod(pos, block)
        block_end = min(end, (lead + 1) * block)
        if off < real:
            seg_end = min(block_end, lead * block + real)
            full_start = info.run_start(lead) + off
            out.append(Piece(key, values[pos - local_start:seg_end - local_start], full_start, full_shape))
        pos = block_end
    return out


class LocalView(Mapping):
    """A single-process state mapping (e.g. a checkpoint reader's lazy one) seen by this rank: reading a
    tensor that ``like_of(key)`` names a local tensor for returns this rank's rows of it (padding zero).
    ``keys``: only these keys are seen (a model part's own, out of the whole model's state)."""

    def __init__(self, full: Mapping, like_of, keys=None):
        self.full, self.like_of = full, like_of
        self.keys_seen = None if keys is None else dict.fromkeys(keys)

    @classmethod
    def of_tensor(cls, full: Mapping, like: torch.Tensor | None) -> LocalView:
        """Every tensor of ``full`` laid out like ``like`` (one parameter's optimizer state)."""
        return cls(full, lambda _key: like)

    def __getitem__(self, key):
        like = self.like_of(key)
        info = None if like is None else shard_info(like)
        if info is not None and info.dim is not None and hasattr(self.full, "read_rows") and \
                self.full.ndim(key) == len(info.full_shape):
            return read_local(self.full, key, like, info)  # this rank's rows only
        value = self.full[key]
        if like is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if info is None or value.shape != torch.Size(info.full_shape):
            return value
        return local_value(value, like, info)

    def ndim(self, key) -> int:
        return self.full.ndim(key) if hasattr(self.full, "ndim") else self[key].dim()

    def read_slice(self, key, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of this rank's flattened tensor ``key`` (a ZeRO shard's piece): read alone
        from a lazy state when the tensor is whole here, else cut from this rank's rows."""
        like = self.like_of(key)
        info = None if like is None else shard_info(like)
        if (info is None or info.dim is None) and hasattr(self.full, "read_slice"):
            return self.full.read_slice(key, start, stop)
        return self[key].reshape(-1)[start:stop]

    def __contains__(self, key) -> bool:
        return key in self.full and (self.keys_seen is None or key in self.keys_seen)

    def __iter__(self):
        return iter(self.full if self.keys_seen is None else [k for k in self.keys_seen if k in self.full])

    def __len__(self):
        return sum(1 for _ in self)
