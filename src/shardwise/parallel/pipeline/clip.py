"""Gradient norm and clipping across pipeline stages.

Each rank holds the gradients of its own stages only, so the global L2 norm is the square root of the
sum over the pipeline group of every rank's local sum of squares (Megatron-LM's ``clip_grad_norm``,
Shoeybi et al. 2019; the norm of Pascanu et al. 2013 §3.2). A weight tied between the first and last
stage is held (with equal, already summed gradients) by both, so only the first stage's copy counts.
Data-parallel replicas hold identical gradients after their all-reduce and are not summed over.
With tensor parallelism inside the stages, the squares of the pieces a rank owns
(``p.tp_shard``, :mod:`shardwise.parallel.tensor`) are first summed over the tensor-parallel group,
and full copies are counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.pipeline.executor import Pipeline


def local_grad_sq(pipe: Pipeline) -> torch.Tensor:
    """fp32 sums of squared gradients of the parameters this rank counts (tied copies once): ``[owned
    tensor-parallel pieces, everything else]``."""
    total = torch.zeros(2, dtype=torch.float32)
    seen: set[int] = set()
    for chunk in pipe.chunks:
        tied = getattr(chunk, "tied_weight", None)
        skip = tied is not None and pipe.stage(pipe.chunks.index(chunk)) != 0
        for p in chunk.parameters():
            if p.grad is None or id(p) in seen or (skip and p is tied):
                continue
            seen.add(id(p))
            info = getattr(p, "tp_shard", None)
            if info is None or info.dim is None:
                total[1] += p.grad.detach().float().pow(2).sum().cpu()
            elif info.owner:
                total[0] += p.grad.detach()[info.local_index()].float().pow(2).sum().cpu()
    return total


def global_grad_norm(pipe: Pipeline, group: dist.ProcessGroup | None = None, tp_group=None) -> torch.Tensor:
    """The L2 norm of every gradient of the model, over the pipeline ``group`` (``Mesh.group("pp")``) and,
    with tensor-parallel stages, their ``tp_group``."""
    sq = local_grad_sq(pipe)
    if tp_group is not None:
        shards = sq[:1].clone()
        dist.all_reduce(shards, group=tp_group)
        sq[0] = shards[0]
    sq = sq.sum().reshape(1)
    dist.all_reduce(sq, group=group)
    return sq[0].sqrt()


def clip_grad_norm(pipe: Pipeline, max_norm: float, group: dist.ProcessGroup | None = None,
                   tp_group=None) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (as ``torch.nn.utils.clip_grad_norm_``);
    returns the norm before clipping."""
    norm = global_grad_norm(pipe, group, tp_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in pipe.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return norm
