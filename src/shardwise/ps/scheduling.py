"""Which ready push goes on the wire next: FIFO, or priority with a credit of bytes in flight.

Gradients become ready during backward from the output towards the input; the next forward needs the
input's layers first. ByteScheduler (Peng et al. SOSP 2019 §3-4) and P3 (Jayarajan et al. SysML 2019 §3)
therefore queue ready partitions by layer (the input's first) and keep only a *credit* of bytes in flight,
so a later, more urgent partition is not stuck behind a long queue already handed to the network.

* ``fifo``: every partition is sent as soon as its gradient is ready;
* ``priority``: ready partitions wait in a heap keyed by (layer, key); one is sent while the bytes in
  flight stay within ``credit_bytes`` (one is always allowed, however large). Queued pushes start as soon
  as credit frees up -- when a send completes (ByteScheduler's "credit-based preemption": the scheduler
  is woken by the completion, not by the next ready tensor) -- as well as when a new partition is ready.

The scheduler measures what it did: bytes whose send started before backward ended (the overlap) and the
time from the end of backward until the last push finished (the exposed communication).
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections.abc import Callable

from shardwise.ps import protocol

POLICIES = ("fifo", "priority")


class Completions:
    """Bytes in flight, retired by a helper thread that waits on each send in order.

    gloo's point-to-point works report completion only to ``wait()``, so the credit of bytes in flight is
    kept by one daemon thread that waits on every push (bounded by ``timeout_s``) and releases its bytes,
    then calls ``on_release`` (the scheduler starts what the freed credit allows); the training thread
    only reads the count. A failed or timed-out send is re-raised in the training thread at its next call."""

    def __init__(self, timeout_s: float, on_release: Callable[[], None] | None = None):
        self.timeout_s = timeout_s
        self.on_release = on_release
        self.in_flight = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ps-push-completions", daemon=True)
        self._thread.start()

    def add(self, work, size: int, what: str) -> None:
        with self._cond:
            self.in_flight += size
        self._queue.put((work, size, what))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, size, what = item
            try:
                protocol.wait(work, self.timeout_s, what)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self.error = self.error or e
            with self._cond:
                self.in_flight -= size
                self._cond.notify_all()
            if self.on_release is not None and self.error is None:
                try:
                    self.on_release()
                except BaseException as e:  # noqa: BLE001 - a send that failed to start: the training thread's
                    self.error = self.error or e

    def wait_until(self, at_most: int) -> None:
        """Block until no more than ``at_most`` bytes are in flight (or a send failed)."""
        with self._cond:
            while self.in_flight > at_most and self.error is None:
                self._cond.wait(timeout=1.0)
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def is_completion_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self) -> None:
        self._queue.put(None)


class PushScheduler:
    """``send(item) -> list of (work, nbytes)``: puts one ready item on the wire (non-blocking)."""

    def __init__(self, policy: str, credit_bytes: int, send: Callable, timeout_s: float):
        if policy not in POLICIES:
            raise ValueError(f"ps.scheduling={policy!r} is not valid; use one of {', '.join(POLICIES)}")
        self.policy, self.credit, self.send = policy, credit_bytes, send
        self._lock = threading.RLock()
        """Held while a push is taken from the heap and started: the training thread (gradient hooks) and
        the completion thread both start pushes, and a push's header and payload must go out in order."""
        self._heap: list = []
        self.backward_done = False
        self.bytes_during_backward = self.bytes_total = 0
        self.max_in_flight = 0
        self.started_by_completion = 0
        """Messages started by the completion thread (when a finished send freed credit), this step."""
        self.flight = Completions(timeout_s, on_release=self._start_queued)

    def ready(self, priority: int, key: int, nbytes: int, item) -> None:
        """A partition's gradient is ready (called from a gradient hook)."""
        with self._lock:
            if self.policy == "fifo":
                self._start(item)
                return
            heapq.heappush(self._heap, (priority, key, nbytes, item))
        self.pump()

    def _fits(self) -> bool:
        return self.flight.in_flight == 0 or self.flight.in_flight + self._heap[0][2] <= self.credit

    def pump(self) -> None:
        """Start queued pushes, most urgent first, while the credit allows (never blocks)."""
        self.flight.check()
        self._start_queued()

    def _start_queued(self) -> None:
        with self._lock:
            while self._heap and self._fits():
                self._start(heapq.heappop(self._heap)[3])

    def _start(self, item) -> None:
        for work, size, what in self.send(item):
            self.flight.add(work, size, what)
            self.bytes_total += size
            if not self.backward_done:
                self.bytes_during_backward += size
            self.started_by_completion += self.flight.is_completion_thread()
        self.max_in_flight = max(self.max_in_flight, self.flight.in_flight)

    def flush(self) -> float:
        """After backward: send what is queued and wait for every push; returns the seconds it took."""
        self.backward_done = True
        t0 = time.perf_counter()
        while True:
            with self._lock:  # the completion thread starts queued pushes too
                if not self._heap:
                    break
                need = self._heap[0][2]
            self.flight.wait_until(max(0, self.credit - need))
            self.pump()
        self.flight.wait_until(0)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.flight.close()

    def pop_metrics(self) -> dict[str, float]:
        """This step's overlap: the fraction of pushed bytes whose send began during backward."""
        frac = self.bytes_during_backward / self.bytes_total if self.bytes_total else 0.0
        out = {"ps_push_overlap_frac": frac, "ps_push_max_in_flight_bytes": float(self.max_in_flight),
               "ps_push_started_on_completion": float(self.started_by_completion)}
        self.bytes_during_backward = self.bytes_total = self.max_in_flight = self.started_by_completion = 0
        self.backward_done = False
        return out
