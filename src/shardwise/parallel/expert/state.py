"""The single-process training state of an expert-parallel model part: who writes which checkpoint pieces.

Expert weights under expert parallelism are rows of the stacked single-process tensors (``p.ep_shard``,
:mod:`shardwise.parallel.expert.dispatch`), which :mod:`shardwise.parallel.tensor.state` slices, loads and
gathers like a tensor-parallel split (its ``shard_info`` reads both). What differs is who writes: the dense weights are
the same on every data-parallel rank, so data-parallel rank 0 writes them (with its own experts); each
other expert shard is written by the first rank that holds it -- the ranks of the first ep group
(``edp`` rank 0). A checkpoint therefore holds the single-process state and resumes on any layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardwise.parallel.tensor.state import gather_pieces, model_pieces, slice_pieces
from shardwise.train.sharded import Piece


def _ep(p: torch.Tensor):
    return getattr(p, "ep_shard", None)


def expert_pieces(module: nn.Module, params: list[nn.Parameter], optimizer_state: Mapping[int, Mapping],
                  state: Mapping[str, torch.Tensor] | None = None) -> list[Piece]:
    """The pieces of this rank's expert shards only: their rows of the model's stacked tensors and of their
    element-wise optimizer moments (scalars such as the step count are written by data-parallel rank 0).
    ``state``: the module's local state dict when it is not ``module.state_dict()`` (ZeRO's gathered one)."""
    infos = {name: _ep(p) for name, p in module.named_parameters(remove_duplicate=False)
             if _ep(p) is not None and _ep(p).owner}
    pieces = [pc for key, t in (module.state_dict() if state is None else state).items() if key in infos
              for pc in slice_pieces(f"model/{key}", t, infos[key])]
    for index, per_param in optimizer_state.items():
        p = params[index]
        info = _ep(p)
        if info is None or not info.owner:
            continue
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
                pieces += slice_pieces(f"optim/{index}/{name}", value, info)
    return pieces


def gather_full_state(module: nn.Module, dp_rank: int, edp_rank: int, tp_rank: int = 0,
                      dst: int = 0, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The whole single-process model state on global rank ``dst``: data-parallel rank 0's pieces (dense
    weights or their tensor-parallel rows, and its experts) and the other experts from the first ep group.
    ``state``: the module's local state (ZeRO: gathered from the shards). A collective over the world."""
    if dp_rank == 0:
        pieces = model_pieces(module, tp_rank, state)
    elif edp_rank == 0:
        pieces = expert_pieces(module, [], {}, state)
    else:
        pieces = []
    return gather_pieces(pieces, dst)
