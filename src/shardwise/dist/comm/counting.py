"""The counting layer: what this rank hands to collectives and puts on the wire, measured where it happens.

Every collective and point-to-point call of a technique records itself in a :class:`CommStats`
(one per mesh axis, held by the engine's :class:`CommLedger`) at the moment it is called, from the
tensors it is handed -- never from a cost formula. Two quantities are kept apart:

* **handed** (``comm_bytes``, ``<axis>_sent_bytes`` in ``metrics.jsonl``): the size of the vector
  the collective works on, in the convention of Thakur, Rabenseifner & Gropp 2005 (IJHPCA 19(1))
  §2 -- the tensor of an all-reduce or broadcast, the *input* of a reduce-scatter and of an
  all-to-all, the *output* of an all-gather, the message of a send. Every rank counts it,
  whatever the algorithm.
* **sent** (``comm_sent_bytes``): the bytes this rank actually put on the wire, counted at every
  point-to-point send (our algorithms in :mod:`.p2p`, the pipeline's activations). The backend's
  own collectives ("native": gloo's or NCCL's all-reduce, reduce-scatter, ...) move their bytes
  inside the backend, where no Python code sees them; a step that used one has no measured
  ``comm_sent_bytes`` -- the ledger reports ``comm_backend_bytes`` (what was handed to them)
  instead of guessing what their algorithm sent.

The planner predicts the same names from its formulas (:mod:`shardwise.plan.compare`); the two are
independent, so ``shardwise plan --compare`` checks one against the other.

A third quantity is a clock, not a count: **exposed** (``<axis>_exposed_s``), the seconds the calling
(compute) thread spent waiting for this axis's communication -- inside a blocking collective, or in the
``wait()`` of one launched earlier -- measured with ``time.perf_counter`` around each wait
(:meth:`CommStats.waiting`). What overlapped the computation costs nothing here; what did not is the time
the step lost to the axis. It is a host clock: on CPU ranks (gloo) it is the exposed communication itself;
on a GPU a wait on an NCCL handle returns once the compute stream is told to wait, so there it measures
only what the host waited (the stream's own stalls need device events).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (its view, not its storage)."""
    return t.numel() * t.element_size()


@dataclass
class CommStats:
    """What one technique (mesh axis) of this rank communicated since the last :meth:`pop`."""

    handed: int = 0
    """Bytes of the vectors handed to collectives and sends (see the module docstring)."""
    backend_handed: int = 0
    """Of ``handed``: bytes handed to the backend's own collectives, whose wire traffic is not visible."""
    bytes_sent: int = 0
    """Bytes put on the wire by point-to-point sends (counted at every ``isend``)."""
    messages: int = 0
    """Point-to-point messages sent."""
    calls: int = 0
    """Collective and send calls recorded."""
    waited_s: float = 0.0
    """Seconds the calling thread waited for this axis's communication (see the module docstring)."""

    def hand(self, size: int, backend: bool) -> None:
        """Record one collective call on a vector of ``size`` bytes (``backend``: the backend's own algorithm)."""
        self.handed += int(size)
        self.calls += 1
        if backend:
            self.backend_handed += int(size)

    def send(self, size: int) -> None:
        """Record one point-to-point message of ``size`` bytes on the wire."""
        self.bytes_sent += int(size)
        self.messages += 1

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the block as waiting for this axis's communication (``with stats.waiting(): work.wait()``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.waited_s += time.perf_counter() - t0

    def wait(self, work) -> None:
        """``work.wait()``, timed as :meth:`waiting` (``None``: nothing to wait for)."""
        if work is not None:
            with self.waiting():
                work.wait()

    def pop(self) -> CommStats:
        """This period's counts; the counters restart from zero."""
        out = CommStats(self.handed, self.backend_handed, self.bytes_sent, self.messages, self.calls, self.waited_s)
        self.handed = self.backend_handed = self.bytes_sent = self.messages = self.calls = 0
        self.waited_s = 0.0
        return out


class CommLedger:
    """One :class:`CommStats` per mesh axis ("dp", "pp", "tp", ...) of one rank, created on first use.

    The engine owns it and hands ``ledger[axis]`` to each technique; the loop reads
    :meth:`pop_metrics` once per step."""

    def __init__(self) -> None:
        self._axes: dict[str, CommStats] = {}

    def __getitem__(self, axis: str) -> CommStats:
        return self._axes.setdefault(axis, CommStats())

    def pop_metrics(self) -> dict[str, float]:
        """This step's counts as metrics: ``comm_bytes`` (handed, every axis), ``<axis>_sent_bytes``
        (handed, per axis), ``<axis>_exposed_s`` (seconds the compute thread waited for the axis),
        ``comm_backend_bytes`` (handed to the backend's own collectives) and, only when every byte of the
        step travelled by point-to-point sends that were counted, ``comm_sent_bytes`` (on the wire)."""
        popped = {axis: s.pop() for axis, s in self._axes.items()}
        out = {f"{axis}_sent_bytes": float(s.handed) for axis, s in popped.items()}
        out.update({f"{axis}_exposed_s": s.waited_s for axis, s in popped.items()})
        out["comm_bytes"] = float(sum(s.handed for s in popped.values()))
        backend = sum(s.backend_handed for s in popped.values())
        out["comm_backend_bytes"] = float(backend)
        if backend == 0:
            out["comm_sent_bytes"] = float(sum(s.bytes_sent for s in popped.values()))
        return out
