"""All-reduce algorithms on point-to-point messages, and the ``all_reduce`` entry point.

Each algorithm sums (or takes the max / min of) a flat tensor in place over a
:class:`~.p2p.Comm` view and leaves *bit-identical* results on every rank (every element
is reduced once, by one rank, in one fixed order -- or by pairs of ranks, whose two
additions ``a+b`` and ``b+a`` agree). Sources are in each docstring; the cost of each is
in :mod:`.cost`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .counting import nbytes
from .p2p import (
    OPS,
    Comm,
    CommStats,
    blocks,
    exchange,
    finish,
    irecv,
    isend,
    make_comm,
    recv,
    recv_reduce,
    reduce_into,
    send,
    verify_same,
    wait,
)
from .primitives import (
    doubling_all_gather,
    fold_view,
    halving_reduce_scatter,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_broadcast,
    tree_reduce,
)

ALL_REDUCE_ALGORITHMS = ("native", "naive", "star", "ring", "rabenseifner", "recursive_doubling", "tree",
                         "hierarchical", "torus")
"""Every all-reduce algorithm by name ("auto" is resolved by :func:`.cost.choose`)."""


def naive(c: Comm, x: torch.Tensor, op: str) -> None:
    """Every rank sends its whole vector to every other and reduces all N in rank order:
    N-1 concurrent messages of S bytes per rank (the direct / "all-to-all" all-reduce)."""
    n = c.size
    bufs = [x if j == c.me else torch.empty_like(x) for j in range(n)]
    recvs = [w for j in range(n) if j != c.me for w in irecv(c, bufs[j], j)]
    sends = [w for j in range(n) if j != c.me for w in isend(c, x, j)]
    wait(c, recvs)
    acc = bufs[0].clone()
    for j in range(1, n):
        reduce_into(acc, bufs[j], op)
    wait(c, sends)
    x.copy_(acc)


def star(c: Comm, x: torch.Tensor, op: str, manager: int = 0) -> None:
    """Parameter-server pattern (Li et al. 2014, "Scaling Distributed Machine Learning with the
    Parameter Server", OSDI, §3): workers push to one manager, which reduces in rank order and
    pushes the result back -- 2(N-1) messages of S bytes through the manager's link."""
    n = c.size
    if c.me != manager:
        send(c, x, manager)
        recv(c, x, manager)
        return
    bufs = {j: torch.empty_like(x) for j in range(n) if j != manager}
    recvs = {j: irecv(c, b, j) for j, b in bufs.items()}
    acc = None
    for j in range(n):
        if j == manager:
            part = x
        else:
            wait(c, recvs[j])
            part = bufs[j]
        if acc is None:
            acc = part.clone()
        else:
            reduce_into(acc, part, op)
    x.copy_(acc)
    wait(c, [w for j in bufs for w in isend(c, x, j)])


def ring(c: Comm, x: torch.Tensor, op: str) -> None:
    """Ring reduce-scatter then ring all-gather (Patarasuk & Yuan 2009, §3): 2(N-1) steps,
    2(N-1)/N * S bytes per rank -- bandwidth optimal; pipelined chunk by chunk across steps
    (see :func:`.primitives.ring_all_reduce`)."""
    ring_all_reduce(c, x, blocks(x.numel(), c.size), op)


def _folded(c: Comm, x: torch.Tensor, op: str, body) -> None:
    """Run ``body(view)`` on the power-of-two fold of ``c`` (Thakur et al. 2005, §4.4)."""
    view, r = fold_view(c)
    if view is None:  # an even rank among the first 2r: hand over, then wait for the result
        send(c, x, c.me + 1)
        recv(c, x, c.me + 1)
        return
    if c.me < 2 * r:
        recv_reduce(c, x, c.me - 1, op)
    body(view)
    if c.me < 2 * r:
        send(c, x, c.me - 1)


def rabenseifner(c: Comm, x: torch.Tensor, op: str) -> None:
    """Recursive-halving reduce-scatter then recursive-doubling all-gather (Rabenseifner 2004,
    "Optimization of collective reduction operations", ICCS; Thakur et al. 2005 §4.4):
    2 log2 p steps, 2(p-1)/p * S bytes per rank; non-powers of two fold first."""
    def body(view: Comm) -> None:
        segs = blocks(x.numel(), view.size)
        halving_reduce_scatter(view, x, segs, op)
        doubling_all_gather(view, x, segs)
    _folded(c, x, op, body)


def recursive_doubling(c: Comm, x: torch.Tensor, op: str) -> None:
    """Butterfly: at distances 1, 2, ..., p/2 partners exchange and reduce whole vectors
    (Thakur et al. 2005, §4.4, the short-message all-reduce): log2 p steps of S bytes."""
    def body(view: Comm) -> None:
        mask = 1
        while mask < view.size:
            partner = view.me ^ mask
            exchange_full(view, x, partner, op)
            mask *= 2
    _folded(c, x, op, body)


def exchange_full(c: Comm, x: torch.Tensor, partner: int, op: str) -> None:
    """Swap whole vectors with ``partner`` and reduce."""
    exchange(c, x.clone(), partner, x, partner, op)  # send a copy: x is reduced into while it travels


def tree(c: Comm, x: torch.Tensor, op: str) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast (Thakur et al. 2005, §3):
    2 ceil(log2 N) steps of S bytes."""
    tree_reduce(c, x, op)
    tree_broadcast(c, x)


def hierarchical(c: Comm, x: torch.Tensor, op: str, node_size: int | None = None) -> None:
    """Two levels, as on clusters of multi-GPU nodes (e.g. Jia et al. 2018, "Highly Scalable Deep
    Learning Training System with Mixed-Precision", §4 hierarchical all-reduce): binomial reduce
    to each node's first rank, ring all-reduce among those leaders, binomial broadcast in the node.
    Nodes are runs of ``node_size`` consecutive ranks (the last one may be shorter); default 2."""
    n = c.size
    L = max(1, min(node_size or 2, n))
    nodes = [list(range(s, min(s + L, n))) for s in range(0, n, L)]
    mine = nodes[c.me // L]
    intra = c.sub(mine)
    tree_reduce(intra, x, op)
    if c.me == mine[0] and len(nodes) > 1:
        ring(c.sub([nd[0] for nd in nodes]), x, op)
    tree_broadcast(intra, x)


def torus_shape(n: int, node_size: int | None = None) -> tuple[int, int]:
    """``(rows, cols)`` of the 2-D grid: ``cols = node_size`` if it divides n, else the most square
    factorisation with rows <= cols (a prime n gives one row: a plain ring)."""
    if node_size and n % node_size == 0:
        return n // node_size, node_size
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


def torus(c: Comm, x: torch.Tensor, op: str, node_size: int | None = None) -> None:
    """2-D torus all-reduce (Mikami et al. 2018, "Massively Distributed SGD: ImageNet/ResNet-50
    Training in a Flash", §3.2; Ying et al. 2018 "Image Classification at Supercomputer Scale",
    §4.2): ring reduce-scatter along rows, ring all-reduce of each shard along columns, ring
    all-gather along rows."""
    rows, cols = torus_shape(c.size, node_size)
    row, col = divmod(c.me, cols)
    row_view = c.sub([row * cols + j for j in range(cols)])
    col_view = c.sub([i * cols + col for i in range(rows)])
    segs = blocks(x.numel(), cols)
    ring_reduce_scatter(row_view, x, segs, op)
    start, length = segs[col]
    if rows > 1 and length:
        ring(col_view, x[start:start + length], op)
    ring_all_gather(row_view, x, segs)


_ALGORITHMS = {"naive": naive, "star": star, "ring": ring, "rabenseifner": rabenseifner,
               "recursive_doubling": recursive_doubling, "tree": tree, "hierarchical": hierarchical,
               "torus": torus}

_NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


def native_all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The backend's own all-reduce -- the baseline every algorithm is measured against.
    ("avg" is a sum divided by N, since gloo has no AVG.)"""
    dist.all_reduce(tensor, op=_NATIVE_OPS[op], group=group)
    return finish(tensor, op, dist.get_world_size(group))


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None,
               algorithm: str = "ring", *, node_size: int | None = None, chunk_bytes: int | None = None,
               verify: bool = True, timeout_s: float | None = None, stats: CommStats | None = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` with the named algorithm; return it.

    Args:
        op: "sum", "avg", "max" or "min".
        algorithm: one of :data:`ALL_REDUCE_ALGORITHMS`.
        node_size: ranks per node for "hierarchical" (default 2) and row length for "torus".
        chunk_bytes: pipelining chunk size (default :data:`.p2p.DEFAULT_CHUNK_BYTES`).
        verify: first check that every rank passes the same count, dtype, op and algorithm
            (one 4-integer all-gather, on by default); a mismatch raises ``ValueError`` naming
            the collective on every rank. ``verify=False`` skips it (benchmarks, or callers that
            check once themselves, like :class:`.compress.GradientAllReduce`): then a mismatch of
            byte size aborts the process inside gloo, or fails at ``timeout_s``, and a same-size
            dtype mismatch gives a wrong answer.
        timeout_s: bound on each wait (default: the process group's timeout).
        stats: if given, records the call (the tensor's bytes) and counts the bytes and messages this
            rank sends (:mod:`.counting`).
    """
    if op not in OPS:
        raise ValueError(f"all_reduce: op={op!r} is not valid; use one of {', '.join(OPS)}")
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"all_reduce: algorithm={algorithm!r} is not valid; use one of "
                         f"{', '.join(ALL_REDUCE_ALGORITHMS)} (or 'auto' through the cost model)")
    name = f"all_reduce/{algorithm}"
    if verify:
        verify_same(group, name, tensor, op, ALL_REDUCE_ALGORITHMS.index(algorithm), timeout_s)
    if stats is not None:
        stats.hand(nbytes(tensor), backend=algorithm == "native")
    if algorithm == "native":
        return native_all_reduce(tensor, op, group)
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    c = make_comm(group, name, timeout_s, stats=stats, **kwargs)
    if c.size == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    fn = _ALGORITHMS[algorithm]
    if algorithm in ("hierarchical", "torus"):
        fn(c, flat, op, node_size)
    else:
        fn(c, flat, op)
    finish(flat, op, c.size)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
