"""Gradient norm and clipping across pipeline stages.

Each rank holds the gradients of its own stages only, so the global L2 norm is the square root of the
sum over the pipeline group of every rank's local sum of squares (Megatron-LM's ``clip_grad_norm``,
Shoeybi et al. 2019; the norm of Pascanu et al. 2013 §3.2). A weight tied between the first and last
stage is held (with equal, already summed gradients) by both, so only the first stage's copy counts.
Data-parallel replicas hold identical gradients after their all-reduce and are not summed over.
With tensor parallelism inside the stages, the squares of the pieces a rank owns
(``p.tp_shard``, :mod:`shardwise.parallel.tensor.layers`) are first summed over the tensor-parallel group,
and full copies are counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.grad_norm import clip_grad_norm as norm_and_clip
from shardwise.parallel.grad_norm import parameter_pieces
from shardwise.parallel.pipeline.executor import Pipeline


def tied_copies_elsewhere(chunks, stages) -> frozenset[int]:
    """The ``id`` of every copy of a table tied between the first and last stages that this rank holds on a
    stage other than the first: the first stage counts the table in the norm, the others skip it.
    ``stages``: each chunk's global stage."""
    return frozenset(id(tied) for chunk, stage in zip(chunks, stages, strict=True)
                     if (tied := getattr(chunk, "tied_weight", None)) is not None and stage != 0)


def _pieces(pipe: Pipeline) -> tuple[list, frozenset[int]]:
    """Every ``(grad, param)`` of the rank's stages, and the tied copy it must not count."""
    pieces = [pc for chunk in pipe.chunks for pc in parameter_pieces(chunk.parameters())]
    skip = tied_copies_elsewhere(pipe.chunks, [pipe.stage(i) for i in range(len(pipe.chunks))])
    return list({id(p): (g, p) for g, p in pieces}.values()), skip


def global_grad_norm(pipe: Pipeline, group: dist.ProcessGroup | None = None, tp_group=None) -> torch.Tensor:
    """The L2 norm of every gradient of the model, over the pipeline ``group`` (``Mesh.group("pp")``) and,
    with tensor-parallel stages, their ``tp_group``."""
    pieces, skip = _pieces(pipe)
    return torch.tensor(norm_and_clip(pieces, 0.0, tp_group=tp_group, pp_group=group or dist.group.WORLD, skip=skip))


def clip_grad_norm(pipe: Pipeline, max_norm: float, group: dist.ProcessGroup | None = None,
                   tp_group=None) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (as ``torch.nn.utils.clip_grad_norm_``);
    returns the norm before clipping."""
    pieces, skip = _pieces(pipe)
    return torch.tensor(norm_and_clip(pieces, max_norm, tp_group=tp_group, pp_group=group or dist.group.WORLD,
                                      skip=skip))
