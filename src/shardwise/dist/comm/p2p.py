"""Point-to-point plumbing shared by every collective algorithm in this package.

A ``Comm`` is a *view* of some ranks of a process group: the algorithms address peers by
their position in that view, so a hierarchical or torus all-reduce can run a ring over
"the ranks of my node" without creating a new process group (``dist.new_group`` is itself
a collective and costly). Messages travel with ``dist.isend``/``dist.irecv`` only, so the
algorithms run on any backend that supports point-to-point (gloo, nccl, mpi).

Large messages are cut into chunks of ``chunk_bytes``: every chunk's receive is posted
first, then every send, and each received chunk is reduced as soon as it arrives, so the
reduction of chunk k overlaps the transfer of chunk k+1 (the pipelining of Patarasuk &
Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations", §4).

Every wait is bounded by ``timeout`` and every failure is re-raised naming the collective
and algorithm (``all_reduce/ring: ...``), so a mismatch never hangs silently. Before the
collective, every public entry point checks by default that all ranks pass the same element
count, dtype, op and algorithm (:func:`verify_same`, one 4-integer all-gather; ``verify=False``
opts out, e.g. for benchmarks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..devices import exchange_device
from .counting import CommStats

OPS = ("sum", "avg", "max", "min")
"""Reduction operators; "avg" is a sum divided by the number of ranks at the end."""

DEFAULT_CHUNK_BYTES = 1 << 20
"""Messages larger than this are pipelined in chunks of this size. 1 MiB: measured on gloo/CPU
(2 and 4 ranks, 16-64 MB all-reduce) it beats 512 KiB (per-message overhead) and 2-4 MiB (a
window of :data:`WINDOW` larger slots is a fresh mmap per call, paid in page faults)."""

WINDOW = 4
"""Chunks of one reducing receive in flight at a time."""

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int64: 5,
                torch.int32: 6, torch.int8: 7, torch.uint8: 8, torch.bool: 9}


@dataclass
class Comm:
    """A view of ``ranks`` (group ranks of ``group``, in algorithm order) as seen by position ``me``.

    Attributes:
        group: the process group messages travel on (``None``: the default group).
        ranks: group ranks taking part; position ``i`` in this list is "virtual rank" ``i``.
        me: this process's position in ``ranks``.
        name: "collective/algorithm", used in every error message.
        timeout: bound on every wait (``None``: the process group's own timeout).
        chunk_bytes: pipelining chunk size.
        stats: optional byte counter shared by the views of one call.
    """

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    me: int
    name: str
    timeout: timedelta | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    stats: CommStats | None = field(default=None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def sub(self, positions: list[int] | tuple[int, ...]) -> Comm:
        """The view of the given positions of this view (this rank must be one of them)."""
        ranks = tuple(self.ranks[p] for p in positions)
        return Comm(self.group, ranks, ranks.index(self.ranks[self.me]), self.name, self.timeout,
                    self.chunk_bytes, self.stats)


def make_comm(group: dist.ProcessGroup | None, name: str, timeout_s: float | None = None,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, stats: CommStats | None = None) -> Comm:
    """The view of a whole process group."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    return Comm(group, tuple(range(n)), me, name, timeout, max(int(chunk_bytes), 1), stats)


# ---- messages ----------------------------------------------------------------------------


def chunks(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    per = max(chunk_bytes // max(t.element_size(), 1), 1)
    return list(t.split(per)) if t.numel() > per else [t]


def wait(c: Comm, works: list) -> None:
    """Wait for every handle, re-raising any failure with the collective's name.

    With ``c.timeout`` the handles are polled against a deadline (a backend's own wait
    cannot always be trusted to give up on a receive whose sender never comes); without it
    the backend's blocking wait applies, bounded by the process group's timeout. A handle that
    reports completion only to its own wait (gloo's sends and receives, which have no future)
    is waited with the time left: gloo gives up on it at the deadline.
    """
    deadline = None if c.timeout is None else time.monotonic() + c.timeout.total_seconds()
    for w in works:
        if w is None:
            continue
        try:
            if deadline is None:
                w.wait()
                continue
            if not _reports_completion(w):
                left = max(deadline - time.monotonic(), 1e-3)
                try:
                    w.wait(timeout=timedelta(seconds=left))
                except RuntimeError:
                    if time.monotonic() >= deadline:
                        raise _timed_out(c) from None
                    raise
                continue
            while not w.is_completed():
                if time.monotonic() > deadline:
                    raise _timed_out(c)
                time.sleep(1e-4)
            w.wait()
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise RuntimeError(f"{c.name}: point-to-point transfer failed on rank {c.ranks[c.me]}: {e}") from e


def _timed_out(c: Comm) -> TimeoutError:
    return TimeoutError(f"{c.name}: timed out after {c.timeout.total_seconds():g} s on rank "
                        f"{c.ranks[c.me]} (do all ranks call it with the same tensor size and dtype?)")


def _reports_completion(work) -> bool:
    """True if ``is_completed()`` turns true once the transfer is done (a handle with a future: NCCL's, gloo's
    collectives); gloo's point-to-point handles have none and complete only inside their own wait."""
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


def post_send(c: Comm, piece: torch.Tensor, peer: int, tag: int = 0):
    """Post one send of ``piece`` to view position ``peer`` (counted in ``c.stats``)."""
    if c.stats is not None:
        c.stats.send(piece.numel() * piece.element_size())
    return dist.isend(piece, group=c.group, group_dst=c.ranks[peer], tag=tag)


def isend(c: Comm, t: torch.Tensor, peer: int) -> list:
    """Post the sends of ``t`` (chunked) to view position ``peer``; return the handles."""
    return [post_send(c, piece, peer, i) for i, piece in enumerate(chunks(t, c.chunk_bytes))]


def irecv(c: Comm, t: torch.Tensor, peer: int) -> list:
    """Post the receives of ``t`` (chunked, into ``t`` itself) from view position ``peer``."""
    return [dist.irecv(piece, group=c.group, group_src=c.ranks[peer], tag=i)
            for i, piece in enumerate(chunks(t, c.chunk_bytes))]


def send(c: Comm, t: torch.Tensor, peer: int) -> None:
    wait(c, isend(c, t, peer))


def recv(c: Comm, t: torch.Tensor, peer: int) -> None:
    wait(c, irecv(c, t, peer))


def exchange(c: Comm, send_t: torch.Tensor | None, send_peer: int | None,
             recv_t: torch.Tensor | None, recv_peer: int | None, op: str | None = None,
             scratch: torch.Tensor | None = None) -> None:
    """Send ``send_t`` to one peer while receiving from another (either may be ``None``).

    Without ``op`` the data is received straight into ``recv_t``. With ``op`` it is *reduced
    into* ``recv_t`` chunk by chunk as each chunk arrives; at most :data:`WINDOW` chunks are
    in flight, received into a small rotating scratch buffer (a full-size one would be a
    fresh mmap -- and a page fault per 4 KiB -- on every call for large messages); a caller
    exchanging many times may pass its own ``scratch`` (see :func:`scratch_for`).
    """
    sends = isend(c, send_t, send_peer) if send_t is not None and send_t.numel() > 0 else []
    if recv_t is None or recv_t.numel() == 0:
        wait(c, sends)
        return
    if op is None:
        wait(c, irecv(c, recv_t, recv_peer))
        wait(c, sends)
        return
    targets = chunks(recv_t, c.chunk_bytes)
    window = min(len(targets), WINDOW)
    if scratch is None or scratch.numel() < window * targets[0].numel() or scratch.dtype != recv_t.dtype:
        scratch = torch.empty(window * targets[0].numel(), dtype=recv_t.dtype, device=recv_t.device)
    slots = scratch[:window * targets[0].numel()].split(targets[0].numel())

    def post(i: int):
        slot = slots[i % window][:targets[i].numel()]
        return slot, dist.irecv(slot, group=c.group, group_src=c.ranks[recv_peer], tag=i)

    pending = [post(i) for i in range(window)]
    for i, dst in enumerate(targets):
        slot, work = pending[i]
        wait(c, [work])
        reduce_into(dst, slot, op)
        if i + window < len(targets):
            pending.append(post(i + window))
    wait(c, sends)


def scratch_for(c: Comm, t: torch.Tensor, numel: int) -> torch.Tensor:
    """A scratch buffer big enough for :func:`exchange` to reduce ``numel`` elements like ``t``."""
    per = max(c.chunk_bytes // max(t.element_size(), 1), 1)
    return torch.empty(min(numel, per * WINDOW), dtype=t.dtype, device=t.device)


def recv_reduce(c: Comm, t: torch.Tensor, peer: int, op: str) -> None:
    """Receive a tensor like ``t`` from ``peer`` and reduce it into ``t``, chunk by chunk."""
    exchange(c, None, None, t, peer, op)


# ---- arithmetic --------------------------------------------------------------------------


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """``dst = dst (op) src`` elementwise; "avg" accumulates a sum (see :func:`finish`)."""
    if op in ("sum", "avg"):
        dst.add_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    else:
        raise ValueError(f"unknown reduction op {op!r}; use one of {OPS}")


def finish(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    """Turn the reduced sum into an average when ``op`` is "avg"."""
    if op == "avg":
        t.div_(n)
    return t


def blocks(numel: int, parts: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``parts`` nearly equal consecutive blocks (the first ``numel % parts`` one longer)."""
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out


def largest_pow2(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def verify_same(group: dist.ProcessGroup | None, name: str, t: torch.Tensor, op: str = "", extra: int = 0,
                timeout_s: float | None = None) -> None:
    """Check that every rank calls ``name`` with the same element count, dtype, op and ``extra``.

    One small all-gather of four integers per call (the backend's own, so that it cannot be
    confused by the very mismatch it looks for). Every rank raises the same ``ValueError``.
    With ``timeout_s`` the all-gather is waited for at most that long (a rank that never comes
    gives a ``TimeoutError`` naming ``name``, instead of the process group's own timeout).
    The four integers live where the group takes host-side exchanges (the CPU, over gloo beside
    nccl; :func:`~shardwise.dist.devices.exchange_device`), whatever device ``t`` is on.
    """
    meta = torch.tensor([t.numel(), _DTYPE_CODES.get(t.dtype, 0), OPS.index(op) if op in OPS else -1, extra],
                        dtype=torch.int64, device=exchange_device(group))
    n = dist.get_world_size(group)
    out = [torch.empty_like(meta) for _ in range(n)]
    work = dist.all_gather(out, meta, group=group, async_op=True)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    wait(Comm(group, tuple(range(n)), dist.get_rank(group), f"{name} (metadata check)", timeout), [work])
    rows = [tuple(int(v) for v in m) for m in out]
    if len(set(rows)) > 1:
        codes = {v: k for k, v in _DTYPE_CODES.items()}
        desc = ", ".join(f"rank {r}: {m[0]} x {codes.get(m[1], '?')} op={OPS[m[2]] if 0 <= m[2] < 4 else '-'}"
                         + (f" extra={m[3]}" if m[3] else "") for r, m in enumerate(rows))
        raise ValueError(f"{name}: ranks disagree on the tensor ({desc})")
