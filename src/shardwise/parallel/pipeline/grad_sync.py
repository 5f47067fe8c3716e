"""Data parallelism around a pipeline: average the gradients once per step, after the last micro-batch.

With pp x dp ranks, the stage ranks of different replicas that hold the same stage form a data-parallel
group (``Mesh.group("dp")``). A pipeline step runs the backward of every micro-batch inside the schedule,
so the gradients are complete only when :meth:`Pipeline.step` returns; they are then averaged over that
group exactly once (Narayanan et al. 2021 §3: "the data-parallel all-reduce ... after the pipeline
flush"), in flat buckets of about ``bucket_mb`` per dtype and device, grouped as DataParallel groups
them (Li et al. 2020 §3.2.2), all launched before any is waited for. Each ``.grad`` then *is* a view of
its bucket, so the buffers (and with them the error-feedback state of compressed all-reduces, keyed
by buffer) persist across steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.data import AllReduceFn, _assign_buckets, native_all_reduce


class GradientSync:
    """Average the ``.grad`` of ``params`` over ``group`` with ``all_reduce_fn`` (sum, in place)."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None,
                 bucket_mb: float = 25.0, all_reduce_fn: AllReduceFn = native_all_reduce):
        unique = list({id(p): p for p in params if p.requires_grad}.values())
        self.group, self.all_reduce_fn = group, all_reduce_fn
        self.world_size = dist.get_world_size(group)
        cap = max(1, int(bucket_mb * 2**20))
        self.buckets = [self._bucket(bucket) for bucket in _assign_buckets(unique, cap)]

    @staticmethod
    def _bucket(params: list[nn.Parameter]) -> tuple[list[nn.Parameter], torch.Tensor]:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        return params, buffer

    @torch.no_grad()
    def __call__(self) -> None:
        """Average every gradient over the group. A parameter without a gradient contributes zeros
        (every parameter of a pipeline stage is used in every step, so this does not arise in training)."""
        if self.world_size == 1:
            return
        works = []
        for params, buffer in self.buckets:
            offset = 0
            for p in params:
                view = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() == view.data_ptr():
                    view.div_(self.world_size)
                else:
                    torch.div(p.grad, self.world_size, out=view)
            works.append(self.all_reduce_fn(buffer, self.group))
        for (params, buffer), work in zip(self.buckets, works, strict=True):
            if work is not None:
                work.wait()
            offset = 0
            for p in params:
                p.grad = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()

