"""Reduce-scatter, all-gather, broadcast, reduce, gather, scatter, all-to-all and barrier,
each with our point-to-point algorithms and the backend's own ("native") as the baseline.

Signatures follow torch.distributed's tensor-in/tensor-out forms (``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``all_to_all_single`` with equal splits), with ``op`` and
``algorithm`` as strings and ``src``/``dst`` as ranks *within* ``group``. Every call first
checks that all ranks pass the same element count, dtype, op, algorithm and root (``verify``,
one small all-gather; see :func:`.p2p.verify_same`) and raises a ``ValueError`` naming the
collective otherwise; ``verify=False`` skips the check (benchmarks) at the risk of a gloo abort
or a wrong answer on a mismatch. Sources: Thakur,
Rabenseifner & Gropp 2005 (IJHPCA 19(1)) §4 for every algorithm here except the
dissemination barrier (Hensgen, Finkel & Manber 1988, "Two algorithms for barrier
synchronization", IJPP 17(1)) and the ring (Patarasuk & Yuan 2009).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..devices import exchange_device
from .allreduce import _NATIVE_OPS
from .counting import nbytes
from .p2p import (
    OPS,
    CommStats,
    blocks,
    exchange,
    finish,
    irecv,
    isend,
    make_comm,
    post_send,
    recv,
    send,
    verify_same,
    wait,
)
from .primitives import (
    chain_broadcast,
    chain_reduce,
    doubling_all_gather,
    fold_segments,
    fold_view,
    halving_reduce_scatter,
    ring_all_gather,
    ring_reduce_scatter,
    tree_broadcast,
    tree_reduce,
)

ALGORITHMS = {
    "reduce_scatter": ("native", "ring", "halving"),
    "all_gather": ("native", "ring", "doubling"),
    "broadcast": ("native", "tree", "chain"),
    "reduce": ("native", "tree", "chain"),
    "gather": ("native", "linear", "tree"),
    "scatter": ("native", "linear", "tree"),
    "all_to_all": ("native", "pairwise"),
    "barrier": ("native", "dissemination"),
}
"""Algorithms of every collective other than all-reduce (see :data:`.allreduce.ALL_REDUCE_ALGORITHMS`)."""

# torch 2.13 renamed the tensor-in/tensor-out forms (the old names warn)
_native_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


_BLOCK_IN = ("all_gather", "gather", "scatter")
"""Collectives whose ``tensor`` argument is this rank's block of an N-block vector."""


def _start(collective: str, algorithm: str, group, tensor, op: str, verify: bool, timeout_s, chunk_bytes, stats,
           extra: int = 0):
    """Check the arguments, verify the ranks agree, record the call in ``stats`` (the vector's bytes:
    N blocks for :data:`_BLOCK_IN`), and return the communicator view."""
    if algorithm not in ALGORITHMS[collective]:
        raise ValueError(f"{collective}: algorithm={algorithm!r} is not valid; use one of "
                         f"{', '.join(ALGORITHMS[collective])}")
    if op and op not in OPS:
        raise ValueError(f"{collective}: op={op!r} is not valid; use one of {', '.join(OPS)}")
    name = f"{collective}/{algorithm}"
    if verify:
        verify_same(group, name, tensor, op, ALGORITHMS[collective].index(algorithm) + 16 * extra, timeout_s)
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    c = make_comm(group, name, timeout_s, stats=stats, **kwargs)
    if stats is not None and collective != "barrier":
        stats.hand(nbytes(tensor) * (c.size if collective in _BLOCK_IN else 1), backend=algorithm == "native")
    return c


def _check_len(name: str, got: int, want: int, what: str) -> None:
    if got != want:
        raise ValueError(f"{name}: {what} has {got} elements, expected {want}")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None, algorithm: str = "ring",
                   *, verify: bool = True, timeout_s=None, chunk_bytes=None, stats: CommStats | None = None):
    """Reduce ``input`` (N equal blocks) over the group; rank r gets block r in ``output``.

    "ring": N-1 steps; "halving": recursive halving, log2 p steps (+2 for non-powers of two).
    """
    c = _start("reduce_scatter", algorithm, group, input, op, verify, timeout_s, chunk_bytes, stats)
    _check_len(c.name, input.numel(), output.numel() * c.size, "input")
    if algorithm == "native":
        _native_reduce_scatter(output, input, op=_NATIVE_OPS[op], group=group)
        return finish(output, op, c.size)
    x = input.reshape(-1).clone()
    segs = blocks(x.numel(), c.size)
    if algorithm == "ring":
        ring_reduce_scatter(c, x, segs, op)
    else:
        view, r = fold_view(c)
        if view is None:
            send(c, x, c.me + 1)
            start, length = segs[c.me]
            recv(c, x[start:start + length], c.me + 1)
        else:
            if c.me < 2 * r:
                exchange(c, None, None, x, c.me - 1, op)
            halving_reduce_scatter(view, x, fold_segments(segs, r), op)
            if c.me < 2 * r:
                start, length = segs[c.me - 1]
                send(c, x[start:start + length], c.me - 1)
    start, length = segs[c.me]
    output.view(-1).copy_(x[start:start + length])
    return finish(output, op, c.size)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, algorithm: str = "ring", *,
               verify: bool = True, timeout_s=None, chunk_bytes=None, stats: CommStats | None = None):
    """Concatenate every rank's ``input`` into ``output`` (N times as long), in rank order.

    "ring": N-1 steps; "doubling": recursive doubling, log2 p steps (+2 for non-powers of two).
    """
    c = _start("all_gather", algorithm, group, input, "", verify, timeout_s, chunk_bytes, stats)
    _check_len(c.name, output.numel(), input.numel() * c.size, "output")
    if algorithm == "native":
        _native_all_gather(output, input, group=group)
        return output
    x = output.view(-1)
    segs = blocks(x.numel(), c.size)
    start, length = segs[c.me]
    x[start:start + length].copy_(input.reshape(-1))
    if algorithm == "ring":
        ring_all_gather(c, x, segs)
        return output
    view, r = fold_view(c)
    if view is None:
        send(c, x[start:start + length], c.me + 1)
        recv(c, x, c.me + 1)
        return output
    if c.me < 2 * r:
        s0, l0 = segs[c.me - 1]
        recv(c, x[s0:s0 + l0], c.me - 1)
    doubling_all_gather(view, x, fold_segments(segs, r))
    if c.me < 2 * r:
        send(c, x, c.me - 1)
    return output


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, algorithm: str = "tree", *, verify: bool = True,
              timeout_s=None, chunk_bytes=None, stats: CommStats | None = None):
    """Copy rank ``src``'s ``tensor`` to every rank. "tree": binomial, ceil(log2 N) steps of S bytes;
    "chain": pipelined chain, N-1 + k-1 steps of S/k bytes (k chunks)."""
    c = _start("broadcast", algorithm, group, tensor, "", verify, timeout_s, chunk_bytes, stats, src)
    if algorithm == "native":
        dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group else src, group=group)
        return tensor
    x = tensor.view(-1)
    (tree_broadcast if algorithm == "tree" else chain_broadcast)(c, x, src)
    return tensor


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", group=None, algorithm: str = "tree", *,
           verify: bool = True, timeout_s=None, chunk_bytes=None, stats: CommStats | None = None):
    """Reduce every rank's ``tensor`` into rank ``dst``'s; other ranks' tensors are left unchanged.
    "tree": binomial; "chain": pipelined chain."""
    c = _start("reduce", algorithm, group, tensor, op, verify, timeout_s, chunk_bytes, stats, dst)
    if algorithm == "native":
        work = tensor if c.me == dst else tensor.clone()
        dist.reduce(work, dst=dist.get_global_rank(group, dst) if group else dst, op=_NATIVE_OPS[op], group=group)
        return finish(tensor, op, c.size) if c.me == dst else tensor
    x = tensor.view(-1) if c.me == dst else tensor.reshape(-1).clone()
    (tree_reduce if algorithm == "tree" else chain_reduce)(c, x, op, dst)
    return finish(tensor, op, c.size) if c.me == dst else tensor


def gather(tensor: torch.Tensor, output: torch.Tensor | None = None, dst: int = 0, group=None,
           algorithm: str = "linear", *, verify: bool = True, timeout_s=None, chunk_bytes=None,
           stats: CommStats | None = None):
    """Concatenate every rank's ``tensor`` into ``output`` (N times as long) on rank ``dst``:
    "linear": every rank sends straight to the root, which posts all receives at once;
    "tree": binomial tree, ceil(log2 N) rounds (see :func:`_tree_gather`)."""
    c = _start("gather", algorithm, group, tensor, "", verify, timeout_s, chunk_bytes, stats, dst)
    if c.me == dst:
        _check_len(c.name, output.numel(), tensor.numel() * c.size, "output")
    if algorithm == "native":
        parts = list(output.view(-1).chunk(c.size)) if c.me == dst else None
        dist.gather(tensor, parts, dst=dist.get_global_rank(group, dst) if group else dst, group=group)
        return output
    if algorithm == "tree":
        _tree_gather(c, tensor.reshape(-1), output.view(-1) if c.me == dst else None, dst)
        return output
    if c.me != dst:
        send(c, tensor.reshape(-1).contiguous(), dst)
        return output
    parts = output.view(-1).split(tensor.numel())
    works = [w for j in range(c.size) if j != dst for w in irecv(c, parts[j], j)]
    parts[dst].copy_(tensor.reshape(-1))
    wait(c, works)
    return output


def scatter(tensor: torch.Tensor, input: torch.Tensor | None = None, src: int = 0, group=None,
            algorithm: str = "linear", *, verify: bool = True, timeout_s=None, chunk_bytes=None,
            stats: CommStats | None = None):
    """Rank r receives block r of rank ``src``'s ``input`` (N blocks) into ``tensor``:
    "linear": the root posts all sends at once; "tree": binomial tree, ceil(log2 N) rounds
    (see :func:`_tree_scatter`)."""
    c = _start("scatter", algorithm, group, tensor, "", verify, timeout_s, chunk_bytes, stats, src)
    if c.me == src:
        _check_len(c.name, input.numel(), tensor.numel() * c.size, "input")
    if algorithm == "native":
        parts = [p.contiguous() for p in input.view(-1).chunk(c.size)] if c.me == src else None
        dist.scatter(tensor, parts, src=dist.get_global_rank(group, src) if group else src, group=group)
        return tensor
    if algorithm == "tree":
        _tree_scatter(c, tensor.view(-1), input.reshape(-1) if c.me == src else None, src)
        return tensor
    if c.me != src:
        recv(c, tensor.view(-1), src)
        return tensor
    parts = input.reshape(-1).split(tensor.numel())
    works = [w for j in range(c.size) if j != src for w in isend(c, parts[j], j)]
    tensor.view(-1).copy_(parts[src])
    wait(c, works)
    return tensor


def _subtree(v: int, n: int) -> int:
    """Ranks in the binomial subtree of relative rank ``v`` (itself included): v .. v+size-1."""
    return n if v == 0 else min(v & -v, n - v)


def _tree_gather(c, mine: torch.Tensor, output: torch.Tensor | None, root: int) -> None:
    """Binomial-tree (minimum-spanning-tree) gather: in round k, relative rank v with bit k set
    sends the blocks of its whole subtree to v - 2^k and leaves; the others receive a subtree
    from v + 2^k. ceil(log2 N) rounds, (N-1)/N * S bytes into the root (Thakur, Rabenseifner &
    Gropp 2005, §3; Chan et al. 2007, "Collective communication: theory, practice, and
    experience", CCPE 19(13), §4.1). Blocks travel in relative-rank order; the root rotates."""
    n, b = c.size, mine.numel()
    v = (c.me - root) % n
    size = _subtree(v, n)
    buf = output if (v == 0 and root == 0) else torch.empty(size * b, dtype=mine.dtype, device=mine.device)
    buf[:b].copy_(mine)
    mask = 1
    while mask < n:
        if v & mask:
            send(c, buf, (v - mask + root) % n)
            return
        if v + mask < n:
            got = _subtree(v + mask, n)
            recv(c, buf[mask * b:(mask + got) * b], (v + mask + root) % n)
        mask <<= 1
    if buf is not output:  # the root: relative block j is rank (j + root)'s block
        output[root * b:].copy_(buf[:(n - root) * b])
        output[:root * b].copy_(buf[(n - root) * b:])


def _tree_scatter(c, mine: torch.Tensor, input: torch.Tensor | None, root: int) -> None:
    """Binomial-tree scatter, the gather's mirror: relative rank v receives its subtree's blocks
    from its parent, then hands each child v + 2^k (largest first) that child's subtree
    (Thakur et al. 2005, §3; Chan et al. 2007, §4.1)."""
    n, b = c.size, mine.numel()
    v = (c.me - root) % n
    size = _subtree(v, n)
    if v == 0:
        buf = input if root == 0 else torch.cat([input[root * b:], input[:root * b]])
    else:
        buf = torch.empty(size * b, dtype=mine.dtype, device=mine.device)
        recv(c, buf, (v - (v & -v) + root) % n)
    works = []
    mask = (v & -v) >> 1 if v else 1 << max(n - 1, 1).bit_length()
    while mask > 0:
        if v + mask < n and mask < size:
            got = _subtree(v + mask, n)
            works += isend(c, buf[mask * b:(mask + got) * b].contiguous(), (v + mask + root) % n)
        mask >>= 1
    mine.copy_(buf[:b])
    wait(c, works)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None, algorithm: str = "pairwise", *,
               verify: bool = True, timeout_s=None, chunk_bytes=None, stats: CommStats | None = None):
    """Block j of rank i's ``input`` becomes block i of rank j's ``output`` (N equal blocks).
    "pairwise": N-1 steps; at step s, send to r+s and receive from r-s (Thakur et al. §4.5)."""
    c = _start("all_to_all", algorithm, group, input, "", verify, timeout_s, chunk_bytes, stats)
    _check_len(c.name, output.numel(), input.numel(), "output")
    if algorithm == "native":
        dist.all_to_all_single(output, input, group=group)
        return output
    n, r = c.size, c.me
    ins = input.reshape(-1).split(input.numel() // n) if input.numel() else [input.reshape(-1)] * n
    outs = output.view(-1).split(output.numel() // n) if output.numel() else [output.view(-1)] * n
    outs[r].copy_(ins[r])
    for s in range(1, n):
        exchange(c, ins[(r + s) % n].contiguous(), (r + s) % n, outs[(r - s) % n], (r - s) % n)
    return output


def all_to_all_v(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                 group=None, algorithm: str = "pairwise", *, timeout_s=None, stats: CommStats | None = None):
    """All-to-all with uneven blocks along dim 0: rows ``input_splits[j]`` of ``input`` go to rank j, which
    receives them as block i (``output_splits[i]`` rows) of its ``output``. The split sizes must agree across
    ranks (exchange them first). "pairwise" as :func:`all_to_all`; "native": ``all_to_all_single`` with splits."""
    c = _start("all_to_all", algorithm, group, input, "", False, timeout_s, None, stats)
    _check_len(c.name, len(input_splits), c.size, "input_splits")
    _check_len(c.name, len(output_splits), c.size, "output_splits")
    if algorithm == "native":
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
        return output
    n, r = c.size, c.me
    ins, outs = input.split(input_splits), output.split(output_splits)
    outs[r].copy_(ins[r])
    for s in range(1, n):
        exchange(c, ins[(r + s) % n].contiguous(), (r + s) % n, outs[(r - s) % n], (r - s) % n)
    return output


def barrier(group=None, algorithm: str = "dissemination", *, timeout_s=None, stats: CommStats | None = None) -> None:
    """No rank leaves before every rank has entered. "dissemination": ceil(log2 N) rounds; in
    round k rank r signals r + 2^k and waits for r - 2^k (Hensgen, Finkel & Manber 1988)."""
    c = _start("barrier", algorithm, group, torch.empty(0), "", False, timeout_s, None, stats)
    if algorithm == "native":
        dist.barrier(group=group)
        return
    device = exchange_device(group)  # the CPU, over gloo beside nccl
    token, got = torch.zeros(1, dtype=torch.uint8, device=device), torch.zeros(1, dtype=torch.uint8, device=device)
    k = 1
    while k < c.size:
        w = irecv(c, got, (c.me - k) % c.size)
        wait(c, [post_send(c, token, (c.me + k) % c.size)] + w)
        k *= 2
