"""Differentiable collectives: the communication of tensor and sequence parallelism as autograd Functions.

Each function is one collective in the forward pass and its adjoint in the backward pass, so a
parallel layer reads like the mathematics and autograd inserts the communication of the backward:

=========================  ==========================  ==========================
function                   forward                     backward
=========================  ==========================  ==========================
``copy_to_region``  (f)    identity                    all-reduce
``reduce_from_region`` (g) all-reduce                  identity
``gather_last_dim``        all-gather, last dim        split, last dim
``split_last_dim``         split, last dim             all-gather, last dim
``gather_seq``             all-gather, dim 1           reduce-scatter, dim 1
``reduce_scatter_seq``     reduce-scatter, dim 1       all-gather, dim 1
``gather_rows``            all-gather, dim 0           reduce-scatter, dim 0
``reduce_scatter_rows``    reduce-scatter, dim 0       all-gather, dim 0
=========================  ==========================  ==========================

f and g are the conjugate pair of Shoeybi et al. 2019, "Megatron-LM", §3 and Fig. 3: f enters a
tensor-parallel region (its input is replicated, the gradients flowing back from the ranks' partial
computations are summed), g leaves it (the ranks' partial outputs are summed). The sequence-parallel
pair replaces them when the activations outside the region are split along the sequence
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2.2):
f becomes an all-gather along the sequence (backward: reduce-scatter), g a reduce-scatter
(backward: all-gather). Our activations are ``[batch, seq, features]``, so the sequence is dim 1.

Splits are equal: the size being split must divide by the group size (gloo cannot all-gather
unequal pieces); a ``ValueError`` says which size does not. Every collective records the vector it
hands to the backend in ``stats`` (:class:`~shardwise.dist.comm.counting.CommStats`, convention of
that module: the tensor of an all-reduce, the output of an all-gather, the input of a
reduce-scatter) before calling it, and the seconds the call blocks (``stats.waiting``: every one of
these is waited for at once, so all of it is exposed). A group of one rank makes every function the
identity and records nothing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from shardwise.dist.comm.counting import CommStats, nbytes

SEQ_DIM = 1
"""The sequence dimension of the activations (``[batch, seq, features]``)."""


# ---- the collectives themselves (no autograd) ---------------------------------------------------


def _size(group) -> int:
    return dist.get_world_size(group)


def _timed(stats: CommStats | None):
    return stats.waiting() if stats is not None else contextlib.nullcontext()


def _all_reduce(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new tensor (never in place: autograd may share ``x``)."""
    out = x.contiguous().clone()
    if stats is not None:
        stats.hand(nbytes(out), backend=True)
    with _timed(stats):
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _check_divides(x: torch.Tensor, dim: int, n: int, what: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) does not divide by the "
            f"group size {n}; only equal splits are supported"
        )


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal piece of ``x`` along ``dim`` (no communication)."""
    n = _size(group)
    _check_divides(x, dim, n, "split")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group, stats: CommStats | None) -> torch.Tensor:
    """The ranks' pieces concatenated along ``dim`` in group-rank order."""
    n = _size(group)
    x = x.contiguous()
    buf = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # the backend's flat form
    if stats is not None:
        stats.hand(nbytes(buf), backend=True)
    with _timed(stats):
        dist.all_gather_single(buf, x, group=group)
    buf = buf.unflatten(0, (n, x.shape[0]))
    # [n, ..., s, ...] -> [..., n, s, ...] -> [..., n*s, ...]
    dim = dim % x.dim()
    return buf.movedim(0, dim).flatten(dim, dim + 1).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group, stats: CommStats | None) -> torch.Tensor:
    """This rank's piece along ``dim`` of the sum of ``x`` over the group."""
    n = _size(group)
    _check_divides(x, dim, n, "reduce-scatter")
    dim = dim % x.dim()
    pieces = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # [n, ..., s/n, ...]
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    if stats is not None:
        stats.hand(nbytes(pieces), backend=True)
    with _timed(stats):
        dist.reduce_scatter_single(out, pieces.flatten(0, 1), op=dist.ReduceOp.SUM, group=group)
    return out


# ---- autograd Functions -------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.stats), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        return _all_reduce(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward: this rank's piece of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group, stats):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _Split(torch.autograd.Function):
    """This rank's piece along ``dim``; backward: all-gather of the gradient pieces."""

    @staticmethod
    def forward(ctx, x, dim, group, stats):
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


class _GatherReduceScatter(torch.autograd.Function):
    """All-gather along ``dim``; backward: reduce-scatter along ``dim`` (the gradient of a replicated
    value computed on every rank is the sum of the ranks' partial gradients)."""

    @staticmethod
    def forward(ctx, x, dim, group, stats):
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return _all_gather(x, dim, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


class _ReduceScatterGather(torch.autograd.Function):
    """Reduce-scatter along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim, group, stats):
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return _reduce_scatter(x, dim, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


# ---- the public functions ------------------------------------------------------------------------


def copy_to_region(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Megatron's f (Shoeybi et al. 2019, §3, Fig. 3a): identity forward, all-reduce of the gradient
    over ``group`` backward. Put it where a replicated activation enters a tensor-parallel region."""
    if _size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group, stats)


def reduce_from_region(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Megatron's g (Shoeybi et al. 2019, §3, Fig. 3b): all-reduce (sum) over ``group`` forward,
    identity backward. Put it where the ranks' partial sums leave a tensor-parallel region."""
    if _size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group, stats)


def gather_last_dim(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """All-gather of the ranks' pieces along the last dim (forward); the gradient is split back
    (backward). E.g. the full output of a column-parallel linear (Shoeybi et al. 2019, §3)."""
    if _size(group) == 1:
        return x
    return _Gather.apply(x, -1, group, stats)


def split_last_dim(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """This rank's equal piece of ``x`` along the last dim (forward); the gradient pieces are
    all-gathered (backward). E.g. the input of a row-parallel linear whose input is replicated."""
    if _size(group) == 1:
        return x
    return _Split.apply(x, -1, group, stats)


def gather_seq(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Sequence parallelism's f (Korthikanti et al. 2022, §4.2.2): all-gather ``[B, T/n, D]`` pieces
    along the sequence (dim 1) into ``[B, T, D]``; backward reduce-scatters the gradient."""
    if _size(group) == 1:
        return x
    return _GatherReduceScatter.apply(x, SEQ_DIM, group, stats)


def reduce_scatter_seq(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Sequence parallelism's g (Korthikanti et al. 2022, §4.2.2): the sum over ranks of ``[B, T, D]``
    partial results, reduce-scattered along the sequence (dim 1) into this rank's ``[B, T/n, D]``;
    backward all-gathers the gradient."""
    if _size(group) == 1:
        return x
    return _ReduceScatterGather.apply(x, SEQ_DIM, group, stats)


def gather_rows(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """The ranks' ``[n, ...]`` pieces stacked along dim 0 into ``[ranks * n, ...]`` (forward); backward
    reduce-scatters the gradient. E.g. tokens every rank of a tensor-parallel group computes on."""
    if _size(group) == 1:
        return x
    return _GatherReduceScatter.apply(x, 0, group, stats)


def reduce_scatter_rows(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """The sum over ranks of ``[ranks * n, ...]`` partial results, this rank's ``[n, ...]`` rows of it (forward);
    backward all-gathers the gradient. The adjoint of :func:`gather_rows`."""
    if _size(group) == 1:
        return x
    return _ReduceScatterGather.apply(x, 0, group, stats)


def all_reduce_grad(grad: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """The sum of a gradient over ``group`` as a new tensor (no autograd). For gradient hooks of
    parameters replicated over a group whose ranks each see part of the data (sequence parallelism)."""
    if _size(group) == 1:
        return grad
    return _all_reduce(grad, group, stats)


__all__ = [
    "SEQ_DIM", "all_reduce_grad", "copy_to_region", "gather_last_dim", "gather_rows", "gather_seq",
    "reduce_from_region", "reduce_scatter_rows",
    "reduce_scatter_seq", "split_last_dim",
]
