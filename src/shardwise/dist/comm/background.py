"""A communication thread: run collective calls in the background, in submission order.

Data-parallel training overlaps gradient communication with the rest of backward (Li et al.
2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 13(12),
§3.2.3). The backend's own collectives are asynchronous already; our point-to-point
algorithms are ordinary blocking Python functions, so they are made asynchronous here by
running them on one background thread -- as torch's own ProcessGroup runs its collectives
on worker threads. One thread, executing calls strictly in the order they were submitted,
keeps the order of collectives the same on every rank (every rank submits its buckets in
the same order), which is what keeps matching point-to-point messages from crossing.

The thread lives for one batch of work: it starts on the first :meth:`CommThread.submit`
and ends in :meth:`CommThread.join`, so no thread outlives a backward pass (and none is
left behind at interpreter exit; it is a daemon besides, so a call stuck in a transfer --
which is bounded by the process group's timeout anyway -- cannot block exit). A failure
in one call is re-raised in the joining thread, naming the call; the calls submitted after
a failed one are not run (their peers cannot be trusted to be in step any more).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

_STOP = object()


class Job:
    """One submitted call: its result once :meth:`CommThread.join` has returned."""

    __slots__ = ("label", "result", "error", "done")

    def __init__(self, label: str):
        self.label = label
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False


class CommThread:
    """Runs submitted calls one at a time, in order, on a background thread (see the module docstring).

    Not thread-safe itself: one owner submits and joins.
    """

    def __init__(self, name: str = "shardwise-comm", device: torch.device | None = None):
        self.name = name
        self.device = device
        """The device the calls' tensors live on: a CUDA one is made the thread's current device (a new thread
        starts on device 0, where a rank whose GPU is another would run any call that names no device)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._jobs: list[Job] = []
        self._failed = threading.Event()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def submit(self, fn: Callable[..., Any], *args: Any, label: str = "") -> Job:
        """Queue ``fn(*args)``; start the thread if it is not running."""
        job = Job(label or getattr(fn, "__name__", repr(fn)))
        self._jobs.append(job)
        if self._thread is None:
            self._failed.clear()
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((job, fn, args))
        return job

    def _serve(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, fn, args = item
            if self._failed.is_set():
                job.error = RuntimeError(f"{job.label}: not run, an earlier communication call failed")
            else:
                try:
                    job.result = fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the joining thread
                    job.error = e
                    self._failed.set()
            job.done = True

    def join(self, raise_errors: bool = True) -> list[Job]:
        """Wait until every submitted call has run; stop the thread; return the jobs.

        With ``raise_errors`` the first failure is re-raised here as a ``RuntimeError``
        naming the call (the original exception is its ``__cause__``).
        """
        jobs, self._jobs = self._jobs, []
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        if raise_errors:
            for job in jobs:
                if job.error is not None:
                    raise RuntimeError(f"{self.name}: {job.label} failed in the communication thread: "
                                       f"{type(job.error).__name__}: {job.error}") from job.error
        return jobs

    def abandon(self) -> None:
        """Skip every call not started yet, then stop the thread (after a backward pass died half-way)."""
        self._failed.set()
        self.join(raise_errors=False)
