"""A process group in which every peer does what this rank does: the engine's parallel code runs on one process.

The simulator traces the engine's own tensor-, sequence-, context- and expert-parallel modules (DESIGN.md: the
simulator runs the engine's code, never a second description of it). Those modules call ``torch.distributed``
on their mesh's groups; :class:`MirrorGroup` answers every call at once, as if each peer held the same tensors
as this rank -- the symmetric case a layout's ranks are in (the simulator's representative rank, with balanced
routing):

* all-reduce: the tensor unchanged (what a sum over equal tensors is, up to the factor the group size);
* all-gather: the input repeated once per rank; reduce-scatter: this rank's block of the input;
* all-to-all: block ``j`` sent to rank ``j`` comes back as block ``j`` (rank ``j`` sends this rank what this rank
  sends the rank as far ahead of it);
* send / receive: a receive takes the message last sent with the same tag and shape (in a ring or a pairwise
  exchange the peer ``s`` behind sends what this rank sends the peer ``s`` ahead), else zeros.

Nothing travels, nothing waits; the copies above run outside any dispatch mode, so a tracer records only the
engine's own operators (the collectives are costed by :mod:`shardwise.sim.layers`). Tensors may live on the
``meta`` device. torch's ``FakeProcessGroup`` (``torch.testing._internal.distributed.fake_pg``) leaves receive
buffers as they were, which data-dependent code (the experts' split sizes) cannot run on; hence this one.

:func:`mirror_mesh` builds this rank's :class:`~shardwise.dist.mesh.Mesh` of a layout on such groups, under a
default process group of its own that exists only inside the ``with`` block: it refuses to run where the
caller already holds a default process group (one process has one), rather than replace it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.utils._python_dispatch import _disable_current_modes

from shardwise.dist.mesh import ALL_AXES, JOINT_AXES, Mesh, ParallelDims

BACKEND = "shardwise_mirror"


class _Done(dist.Work):
    """A request that completed when it was made."""

    def __init__(self, result=None):
        super().__init__()
        self._future: Future = Future()
        self._future.set_result(result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future:
        return self._future


class MirrorGroup(dist.ProcessGroup):
    """``size`` ranks that all hold what this one holds (see the module docstring)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._sent: dict[tuple, torch.Tensor] = {}

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def allreduce(self, tensors, opts=None):
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):
        return _Done(tensors)

    def barrier(self, opts=None):
        return _Done()

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts=None):
        with _disable_current_modes():
            out.copy_(inp.repeat(out.shape[0] // max(inp.shape[0], 1), *[1] * (inp.dim() - 1)))
        return _Done([out])

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts=None):
        with _disable_current_modes():
            out.copy_(inp.reshape(-1)[: out.numel()].view_as(out))
        return _Done([out])

    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, opts=None):
        with _disable_current_modes():
            out.copy_(inp)
        return _Done([out])

    def send(self, tensors, dst: int, tag: int):
        self._sent[(tag, tuple(tensors[0].shape), tensors[0].dtype)] = tensors[0]
        return _Done()

    def recv(self, tensors, src: int, tag: int):
        t = tensors[0]
        sent = self._sent.pop((tag, tuple(t.shape), t.dtype), None)
        with _disable_current_modes():
            t.copy_(sent) if sent is not None else t.zero_()
        return _Done(tensors)


def _create(store, rank: int, size: int, timeout) -> MirrorGroup:
    return MirrorGroup(rank, size)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend.backend_list and BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "meta"])


@contextmanager
def mirror_mesh(dims: ParallelDims) -> Iterator[Mesh]:
    """Rank 0's mesh of ``dims`` on mirror groups (one per axis), valid inside the ``with`` block."""
    if dist.is_initialized():
        raise RuntimeError("the simulator traces the engine's parallel layers on a process group of its own; call "
                           "it from a process that has not initialised torch.distributed")
    _register()
    dims.validate()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=dims.world_size)
    try:
        groups, ranks, made = {}, {}, {}
        for axis in (*ALL_AXES, *JOINT_AXES):
            mine = next(g for g in dims.groups(axis) if 0 in g)
            if tuple(mine) not in made:
                made[tuple(mine)] = dist.new_group(mine)
            groups[axis], ranks[axis] = made[tuple(mine)], mine
        yield Mesh(dims=dims, global_rank=0, _groups=groups, _ranks=ranks)
    finally:
        dist.destroy_process_group()


__all__ = ["MirrorGroup", "mirror_mesh"]
