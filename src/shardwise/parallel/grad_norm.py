"""One global gradient norm and clip for every layout, from what each gradient piece is.

The norm is that of the single-process gradient (Pascanu et al. 2013, "On the difficulty of training
recurrent neural networks", §3.2; as ``torch.nn.utils.clip_grad_norm_`` computes it), however the layout
spreads it. Each piece a rank holds is counted exactly once, from its parameter's metadata and the
groups the caller names (Megatron-LM's ``clip_grad_norm`` does the same over its model-parallel group;
nanotron keys it on each parameter's ShardedInfo):

* a tensor-parallel split (``p.tp_shard.dim`` set, :mod:`shardwise.parallel.tensor.layers`): its squares are
  summed over ``tp_group``; a rank that holds a replica it does not own leaves it out;
* a full copy on every tensor-parallel rank (``dim`` None, or no tensor parallelism): counted locally;
* an expert-parallel shard (``p.ep_shard``, :mod:`shardwise.parallel.expert.dispatch`): this rank's experts;
  their squares are summed over ``ep_group`` -- and over ``tp_group`` too where each expert is split over tp
  (:mod:`shardwise.parallel.expert.tensor`);
* a ZeRO shard's slice: summed over ``shard_group`` (the data-parallel group the shards split);
* a pipeline stage's: summed over ``pp_group``; a weight tied between two stages is counted by one
  (its ``id`` in ``skip`` on the other).

Data-parallel replicas hold equal, already averaged gradients: they are not summed over.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def clip_grad_norm(pieces: Iterable[tuple[torch.Tensor, nn.Parameter]], max_norm: float, *,
                   tp_group: dist.ProcessGroup | None = None, shard_group: dist.ProcessGroup | None = None,
                   pp_group: dist.ProcessGroup | None = None, skip: frozenset[int] = frozenset(),
                   device: torch.device | None = None, ep_group: dist.ProcessGroup | None = None) -> float:
    """The global L2 norm of the gradient whose ``(gradient piece, its parameter)`` pairs this rank holds;
    with ``max_norm > 0`` every piece is scaled by ``min(1, max_norm / (norm + 1e-6))``. A collective over
    the groups given (every rank of them must call it); a group left ``None`` is not reduced over (pass
    ``dist.group.WORLD`` for the default group). ``device``: where the reductions run when this rank holds
    no piece. The norm is read on the host: :func:`clip_grad_norm_on_device` leaves it on the device."""
    return float(clip_grad_norm_on_device(pieces, max_norm, tp_group=tp_group, shard_group=shard_group,
                                          pp_group=pp_group, skip=skip, device=device, ep_group=ep_group))


@torch.no_grad()
def clip_grad_norm_on_device(pieces: Iterable[tuple[torch.Tensor, nn.Parameter]], max_norm: float, *,
                             tp_group: dist.ProcessGroup | None = None, shard_group: dist.ProcessGroup | None = None,
                             pp_group: dist.ProcessGroup | None = None, skip: frozenset[int] = frozenset(),
                             device: torch.device | None = None,
                             ep_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`clip_grad_norm`, the norm returned as a 0-dim fp32 tensor on the device: nothing waits for it
    (the trainer reads it one step late, :mod:`shardwise.train.readout`)."""
    pieces = [(g, p) for g, p in pieces if g is not None]
    # [tensor-parallel splits, everything else, expert shards, expert shards of tensor-parallel splits]
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for g, p in pieces:
        if id(p) in skip:
            continue
        experts = getattr(p, "ep_shard", None)
        split = experts is not None and hasattr(experts, "split")  # experts split over tp too
        if ep_group is not None and experts is not None:
            parts[3 if split else 2].append(g)
            continue
        # (ZeRO slices expert shards over their replicas: its shard group already sums over ep)
        info = (experts if split else getattr(p, "tp_shard", None)) if tp_group is not None else None
        if info is None or info.dim is None:
            parts[1].append(g)
        elif info.owner:  # a whole local tensor: its real rows; a ZeRO slice of one: all of it (padding is 0)
            parts[0].append(g[info.local_index()] if g.shape == p.shape else g)
    if device is None:
        device = pieces[0][0].device if pieces else torch.device("cpu")
    reduced = [g for g in (tp_group, shard_group, ep_group, pp_group) if g is not None and dist.get_world_size(g) > 1]
    filled = [part for part in parts if part]
    if not reduced and len(filled) == 1:  # nothing to add: the root of the one square, as below (the same bits, an
        # overflow to inf included, where torch's own norm would stay finite), in fewer operators
        norm = _part_norm(filled[0], device).pow(2).sqrt()
        _clip([g for g, _ in pieces], max_norm, norm)
        return norm
    local = torch.zeros(4, dtype=torch.float32, device=device)
    for i, part in enumerate(parts):  # each part's norm as torch.nn.utils.clip_grad_norm_ computes it
        if part:
            local[i] = _part_norm(part, device)
    sq = local.pow(2)  # squares add over ranks; with nothing to add, sqrt(fl(r * r)) = r: torch's norm, bit for bit
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        dist.all_reduce(sq, group=shard_group)
    if tp_group is not None:
        splits = sq[[0, 3]]
        dist.all_reduce(splits, group=tp_group)
        sq[[0, 3]] = splits
    if ep_group is not None:
        experts = sq[2:].clone()
        dist.all_reduce(experts, group=ep_group)
        sq[2:] = experts
    total = sq.sum().reshape(1)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total[0].sqrt()
    _clip([g for g, _ in pieces], max_norm, norm)
    return norm


def _part_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of ``grads`` together, as ``torch.nn.utils.clip_grad_norm_`` computes it (fp32, on ``device``)."""
    return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)])).to(device)


def _clip(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` by ``min(1, max_norm / (norm + 1e-6))`` (nothing where ``max_norm`` is 0)."""
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def parameter_pieces(params: Iterable[nn.Parameter]) -> list[tuple[torch.Tensor, nn.Parameter]]:
    """``(p.grad, p)`` for each distinct parameter with a gradient."""
    return [(p.grad, p) for p in dict.fromkeys(params) if p.grad is not None]
