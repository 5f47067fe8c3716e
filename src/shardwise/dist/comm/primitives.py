"""The building blocks of the collective algorithms, each on a :class:`~.p2p.Comm` view.

Every function here is collective over the view ``c`` and works in place on a flat,
contiguous tensor ``x``. ``segs`` is a list of ``(start, length)`` consecutive segments of
``x``, one per position of the view (uneven lengths, even zero, are fine).

Sources: ring reduce-scatter / all-gather -- Patarasuk & Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations" (JPDC 69(2)), §3; recursive halving
and doubling, and the fold that handles non-powers of two -- Thakur, Rabenseifner & Gropp
2005, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 19(1)),
§4.4 and Fig. 4; binomial trees and pipelined chains -- ibid. §3, and Chan et al. 2007,
"Collective communication: theory, practice, and experience" (CCPE 19(13)), §4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import (
    WINDOW,
    Comm,
    blocks,
    chunks,
    exchange,
    irecv,
    isend,
    largest_pow2,
    post_send,
    recv,
    recv_reduce,
    reduce_into,
    scratch_for,
    send,
    wait,
)


def span(x: torch.Tensor, segs: list[tuple[int, int]], lo: int, hi: int) -> torch.Tensor:
    """The slice of ``x`` covering segments ``lo .. hi-1``."""
    start = segs[lo][0]
    end = segs[hi - 1][0] + segs[hi - 1][1]
    return x[start:end]


# ---- rings --------------------------------------------------------------------------------


def ring_reduce_scatter(c: Comm, x: torch.Tensor, segs: list[tuple[int, int]], op: str) -> None:
    """N-1 steps; afterwards position i holds the reduction of segment i (others hold partial sums)."""
    n, r = c.size, c.me
    scratch = scratch_for(c, x, max(length for _, length in segs)) if n > 1 else None
    for s in range(n - 1):
        so, sl = segs[(r - s - 1) % n]
        ro, rl = segs[(r - s - 2) % n]
        exchange(c, x[so:so + sl], (r + 1) % n, x[ro:ro + rl], (r - 1) % n, op, scratch)


def ring_all_gather(c: Comm, x: torch.Tensor, segs: list[tuple[int, int]]) -> None:
    """N-1 steps; position i contributes segment i and ends with every segment."""
    n, r = c.size, c.me
    for s in range(n - 1):
        so, sl = segs[(r - s) % n]
        ro, rl = segs[(r - s - 1) % n]
        exchange(c, x[so:so + sl], (r + 1) % n, x[ro:ro + rl], (r - 1) % n)


RING_MAX_CHUNKS = 32
"""At most this many chunks per segment in :func:`ring_all_reduce` (chunks grow past ``chunk_bytes``
for very large messages): every chunk is a hand-off through this process's Python thread, which
with more ranks than cores waits for a time slice. (On gloo/CPU, 2-4 ranks on 2 cores, 64 MB:
8 and 32 were within noise of each other on the median, 32 better on the best run.)"""

RING_SCRATCH_BYTES = 8 << 20
"""Bound on the reducing receives' scratch window (fewer slots for bigger chunks, at least two): a
larger fresh buffer is an mmap of its own on every call, paid in page faults."""


def ring_all_reduce(c: Comm, x: torch.Tensor, segs: list[tuple[int, int]], op: str) -> None:
    """Ring reduce-scatter then ring all-gather as *one* pipeline of 2(N-1) steps.

    Step t sends segment r-t-1 to the right and receives segment r-t-2 from the left
    (reducing it into ``x`` for t < N-1, copying it for the all-gather steps after), so the
    segment sent at step t+1 is the one received at step t. Each segment is cut into the same
    number of chunks, and chunk k of step t+1 is sent as soon as chunk k of step t has
    arrived (and been reduced): steps overlap chunk by chunk instead of ending in a wait for
    the whole segment -- the segmented / pipelined ring (Patarasuk & Yuan 2009, §4; the
    schedule of gloo's and NCCL's ring all-reduce). Same 2(N-1) steps and 2(N-1)/N * S bytes
    per rank as :func:`ring_reduce_scatter` + :func:`ring_all_gather`, and the same
    additions in the same order (bit-identical results).

    All-gather receives go straight into ``x`` and are posted up front; reducing receives
    land in a rotating window of :data:`.p2p.WINDOW` chunk-sized scratch slots. (A chunk
    received during the all-gather overwrites data this rank sent earlier; it cannot arrive
    before that send was consumed, since the reduced chunk includes this rank's contribution.)
    """
    n, r = c.size, c.me
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    longest = max(length for _, length in segs)
    k_chunks = min(max(1, -(-longest * x.element_size() // c.chunk_bytes)), RING_MAX_CHUNKS)
    pieces = [[x[start + o:start + o + ln] for o, ln in blocks(length, k_chunks)] for start, length in segs]
    steps = 2 * (n - 1)

    def piece(t: int, k: int, sending: bool) -> torch.Tensor:
        return pieces[(r - t - (1 if sending else 2)) % n][k]

    reducing = [(t, k) for t in range(n - 1) for k in range(k_chunks) if piece(t, k, False).numel()]
    slot_len = -(-longest // k_chunks)
    window = min(max(2, min(WINDOW, RING_SCRATCH_BYTES // max(slot_len * x.element_size(), 1))), len(reducing))
    scratch = torch.empty(window * slot_len, dtype=x.dtype, device=x.device).split(slot_len) if window else []
    pending: dict[tuple[int, int], tuple] = {}

    def post_reducing(i: int) -> None:
        t, k = reducing[i]
        slot = scratch[i % window][:piece(t, k, False).numel()]
        pending[t, k] = (slot, dist.irecv(slot, group=c.group, group_src=c.ranks[left], tag=t * k_chunks + k))

    for i in range(window):
        post_reducing(i)
    for t in range(n - 1, steps):  # all-gather receives: straight into x
        for k in range(k_chunks):
            dst = piece(t, k, False)
            if dst.numel():
                pending[t, k] = (None, dist.irecv(dst, group=c.group, group_src=c.ranks[left],
                                                  tag=t * k_chunks + k))
    sends = [post_send(c, p, right, k) for k, p in enumerate(pieces[(r - 1) % n]) if p.numel()]
    posted = window
    for t in range(steps):
        for k in range(k_chunks):
            dst = piece(t, k, False)
            if not dst.numel():
                continue
            slot, work = pending.pop((t, k))
            wait(c, [work])
            if slot is not None:
                reduce_into(dst, slot, op)
                if posted < len(reducing):
                    post_reducing(posted)
                    posted += 1
            if t + 1 < steps:
                sends.append(post_send(c, dst, right, (t + 1) * k_chunks + k))
    wait(c, sends)


# ---- recursive halving / doubling (power-of-two views) ----------------------------------


def halving_reduce_scatter(c: Comm, x: torch.Tensor, segs: list[tuple[int, int]], op: str) -> None:
    """log2 p steps at distances p/2, p/4, ..., 1; position v ends owning the reduced segment v."""
    p, v = c.size, c.me
    lo, hi, mask = 0, p, p // 2
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        exchange(c, span(x, segs, *give), v ^ mask, span(x, segs, *keep), v ^ mask, op)
        lo, hi = keep
        mask //= 2


def doubling_all_gather(c: Comm, x: torch.Tensor, segs: list[tuple[int, int]]) -> None:
    """log2 p steps at distances 1, 2, ..., p/2; each step doubles the segments a position holds."""
    p, v = c.size, c.me
    mask = 1
    while mask < p:
        partner = v ^ mask
        mine = (v // mask) * mask
        theirs = (partner // mask) * mask
        exchange(c, span(x, segs, mine, mine + mask), partner, span(x, segs, theirs, theirs + mask), partner)
        mask *= 2


def fold_view(c: Comm) -> tuple[Comm | None, int]:
    """The power-of-two view of Thakur et al. §4.4: of the first 2r positions (r = n - p'),
    the even ones hand their data to their odd neighbour and sit out.

    Returns ``(view or None if this rank sits out, r)``; virtual rank v is position
    2v+1 for v < r and v+r otherwise.
    """
    n = c.size
    p = largest_pow2(n)
    r = n - p
    if c.me < 2 * r and c.me % 2 == 0:
        return None, r
    return c.sub([2 * v + 1 if v < r else v + r for v in range(p)]), r


def fold_segments(segs: list[tuple[int, int]], r: int) -> list[tuple[int, int]]:
    """Merge the segments of each sitting-out position with its odd neighbour's (for the folded view)."""
    out = [(segs[2 * v][0], segs[2 * v][1] + segs[2 * v + 1][1]) for v in range(r)]
    return out + list(segs[2 * r:])


# ---- binomial trees and pipelined chains --------------------------------------------------


def tree_reduce(c: Comm, x: torch.Tensor, op: str, root: int = 0) -> None:
    """Binomial-tree reduce to position ``root``: ceil(log2 n) rounds."""
    n, v = c.size, (c.me - root) % c.size
    mask = 1
    while mask < n:
        if v & mask:
            send(c, x, (v - mask + root) % n)
            return
        if v + mask < n:
            recv_reduce(c, x, (v + mask + root) % n, op)
        mask <<= 1


def tree_broadcast(c: Comm, x: torch.Tensor, root: int = 0) -> None:
    """Binomial-tree broadcast from position ``root``: ceil(log2 n) rounds."""
    n, v = c.size, (c.me - root) % c.size
    mask = 1
    while mask < n:
        if v & mask:
            recv(c, x, (v - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    works = []
    while mask > 0:
        if v + mask < n:
            works += isend(c, x, (v + mask + root) % n)
        mask >>= 1
    wait(c, works)


def chain_broadcast(c: Comm, x: torch.Tensor, root: int = 0) -> None:
    """Pipelined chain root -> root+1 -> ...: each chunk is forwarded as soon as it arrives."""
    n, v = c.size, (c.me - root) % c.size
    nxt = (c.me + 1) % n if v < n - 1 else None
    prv = (c.me - 1) % n
    pieces = chunks(x, c.chunk_bytes)
    recvs = irecv(c, x, prv) if v > 0 else [None] * len(pieces)
    sends = []
    for i, (w, piece) in enumerate(zip(recvs, pieces, strict=True)):
        wait(c, [w])
        if nxt is not None:
            sends.append(post_send(c, piece, nxt, i))
    wait(c, sends)


def chain_reduce(c: Comm, x: torch.Tensor, op: str, root: int = 0) -> None:
    """Pipelined chain root+n-1 -> ... -> root+1 -> root, reducing each chunk on the way."""
    n, v = c.size, (c.me - root) % c.size
    prv = (c.me - 1) % n if v > 0 else None  # towards the root
    nxt = (c.me + 1) % n if v < n - 1 else None  # away from the root
    if nxt is None:
        wait(c, isend(c, x, prv))
        return
    buf = torch.empty_like(x)
    recvs = irecv(c, buf, nxt)
    sends = []
    for i, (w, piece, got) in enumerate(zip(recvs, chunks(x, c.chunk_bytes), chunks(buf, c.chunk_bytes),
                                            strict=True)):
        wait(c, [w])
        reduce_into(piece, got, op)
        if prv is not None:
            sends.append(post_send(c, piece, prv, i))
    wait(c, sends)
