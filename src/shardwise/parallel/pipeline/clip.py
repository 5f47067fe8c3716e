"""Gradient norm and clipping across pipeline stages.

Each rank holds the gradients of its own stages only, so the global L2 norm is the square root of the
sum over the pipeline group of every rank's local sum of squares (Megatron-LM's ``clip_grad_norm``,
Shoeybi et al. 2019; the norm of Pascanu et al. 2013 §3.2). A weight tied between the first and last
stage is held (with equal, already summed gradients) by both, so only the first stage's copy counts.
Data-parallel replicas hold identical gradients after their all-reduce and are not summed over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.pipeline.executor import Pipeline


def local_grad_sq(pipe: Pipeline) -> torch.Tensor:
    """fp32 sum of squared gradients of the parameters this rank counts (tied copies once)."""
    total = torch.zeros((), dtype=torch.float32)
    seen: set[int] = set()
    for chunk in pipe.chunks:
        tied = getattr(chunk, "tied_weight", None)
        skip = tied is not None and pipe.stage(pipe.chunks.index(chunk)) != 0
        for p in chunk.parameters():
            if p.grad is None or id(p) in seen or (skip and p is tied):
                continue
            seen.add(id(p))
            total += p.grad.detach().float().pow(2).sum().cpu()
    return total


def global_grad_norm(pipe: Pipeline, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of every gradient of the model, over the pipeline ``group`` (``Mesh.group("pp")``)."""
    sq = local_grad_sq(pipe)
    dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_grad_norm(pipe: Pipeline, max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (as ``torch.nn.utils.clip_grad_norm_``);
    returns the norm before clipping."""
    norm = global_grad_norm(pipe, group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in pipe.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return norm
