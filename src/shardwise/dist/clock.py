"""One clock for the timelines of a step: the host's on a CPU, the device's events on a GPU.

A CPU has done its work when the call that did it returns, so ``time.perf_counter`` around a computation times
the computation. A GPU has only been *asked* to do it: the call returns once the kernels are queued, and a
host clock around it times the launches. CUDA events are recorded into the stream in order with the kernels
and stamped by the device when it reaches them, so the time between two events is the device's
(CUDA C++ Programming Guide, "Events"; ``torch.cuda.Event(enable_timing=True)``).

A :class:`Clock` hands out **stamps** while the step runs (:meth:`Clock.stamp`: a host time, or an event recorded
on the current -- the compute -- stream, which waits for nothing) and turns them into seconds after the step,
all at once (:meth:`Clock.seconds`). The device clock does it with one wait: it records a last event, waits for
it, reads the host clock at that moment, and places every stamp at ``host_now - elapsed(stamp, last)``. The
seconds of both clocks are on the host's ``perf_counter`` scale (``CLOCK_MONOTONIC`` on Linux), so stamps of
different ranks of one machine compare, as the pipeline's bubble needs.

Users: the pipeline timeline, its bubble and replayed bubble (:mod:`shardwise.parallel.pipeline.timeline`), the
context-parallel attention seconds (:mod:`shardwise.parallel.context.core`) and the checkpoint stall
(``ckpt_stall_s``, :mod:`shardwise.train.loop`). Where only durations are wanted (the attention seconds, read
one step late) :meth:`Clock.durations` waits for the step's own last stamp, which is done by then.
:class:`EventClock` takes the event type as an argument, so its arithmetic is tested on a CPU with a fake device
(``tests/test_clock.py``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class Clock:
    """Stamps during a step, seconds after it (module docstring)."""

    def stamp(self) -> Any:
        raise NotImplementedError

    def seconds(self, stamps: Sequence[Any]) -> list[float]:
        """Every stamp in host ``perf_counter`` seconds (at most one wait for the device)."""
        raise NotImplementedError

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``."""
        t0, t1 = self.seconds([start, end])
        return t1 - t0

    def durations(self, pairs: Sequence[tuple[Any, Any]]) -> list[float]:
        """Seconds from each ``(start, end)`` pair's start to its end, stamped in that order: at most one wait, for
        the last end stamp itself (no new one), so a step read once the device is past it waits for nothing."""
        return [t1 - t0 for t0, t1 in (self.seconds(pair) for pair in pairs)]


class HostClock(Clock):
    """``time.perf_counter``: a stamp is already seconds."""

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, stamps: Sequence[float]) -> list[float]:
        return [float(s) for s in stamps]


class EventClock(Clock):
    """Events recorded on the current stream of a device (``event``: the event type, default
    ``torch.cuda.Event(enable_timing=True)``; ``host``: the host clock the seconds are placed on)."""

    def __init__(self, event: Callable[[], Any] | None = None, host: Callable[[], float] = time.perf_counter):
        self.event = event or functools.partial(torch.cuda.Event, enable_timing=True)
        self.host = host

    def stamp(self) -> Any:
        e = self.event()
        e.record()
        return e

    def seconds(self, stamps: Sequence[Any]) -> list[float]:
        if not stamps:
            return []
        last = self.stamp()
        last.synchronize()  # the one wait: every earlier stamp of the stream is done too
        now = self.host()
        return [now - s.elapsed_time(last) / 1000.0 for s in stamps]

    def durations(self, pairs: Sequence[tuple[Any, Any]]) -> list[float]:
        if not pairs:
            return []
        pairs[-1][1].synchronize()  # the stream's order: every earlier stamp is done too
        return [start.elapsed_time(end) / 1000.0 for start, end in pairs]


def clock_for(device: torch.device | str | None) -> Clock:
    """The clock of ``device``: CUDA events on a CUDA device, the host clock elsewhere."""
    return EventClock() if device is not None and torch.device(device).type == "cuda" else HostClock()
