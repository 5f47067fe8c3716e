"""What each pipeline rank did and when: recording, bubble and memory measures, Gantt chart, Chrome trace.

A :class:`Timeline` holds one rank's events of one step -- ``F``/``B``/``W`` (compute; ``W`` only in
split-backward schedules), ``send``/``recv`` (posting communication) and ``wait`` (blocked on a
receive) -- as ``(kind, stage, mb, start, end)`` in seconds of the host's ``perf_counter``
(``CLOCK_MONOTONIC`` on Linux, so comparable between processes of one machine). A :class:`Recorder` takes
them while the step runs on the device's clock (:mod:`shardwise.dist.clock`: the host clock on a CPU, CUDA
events on the compute stream on a GPU, where a host clock would time the launches) and makes the timeline
after the step, reading the device once.
:func:`bubble_fraction` compares the busy time of every rank with the span of the whole step;
:func:`replayed_bubble` replays the schedule with the measured compute times and free communication, which
separates what the stages' unequal work costs from what executing the schedule costs. The
theoretical value is :func:`~shardwise.parallel.pipeline.schedules.theoretical_bubble` (Narayanan et
al. 2021 §2.2), or :func:`~shardwise.parallel.pipeline.schedules.zb_h1_bubble` for ZB-H1 (Qi et al.
2024 §3.1). The Chrome trace follows the Trace Event Format ("X" complete events;
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.dist.clock import Clock, HostClock
from shardwise.parallel.pipeline.schedules import Action, simulate

COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Event:
    """One interval of one rank: ``kind`` in F, B, W, send, recv, wait; ``stage`` is the global stage."""

    kind: str
    stage: int
    mb: int
    start: float
    end: float


@dataclass
class Timeline:
    """The events of one pipeline rank in one step, and its peak number of live micro-batch activations."""

    rank: int
    events: list[Event] = field(default_factory=list)
    peak_live: int = 0
    start: float = 0.0
    end: float = 0.0

    def busy(self) -> float:
        """Seconds spent in forward and backward computation."""
        return sum(e.end - e.start for e in self.events if e.kind in COMPUTE)


class Recorder:
    """One rank's step as it runs: ``(kind, stage, mb)`` intervals stamped on ``clock``, made a :class:`Timeline`
    by :meth:`timeline` after the step (one read of the clock)."""

    def __init__(self, rank: int, clock: Clock | None = None):
        self.rank, self.clock = rank, clock or HostClock()
        self.spans: list[tuple[str, int, int, Any, Any]] = []
        self.peak_live = 0
        self.start = self.end = None

    def now(self) -> Any:
        return self.clock.stamp()

    def add(self, kind: str, stage: int, mb: int, start: Any, end: Any) -> None:
        self.spans.append((kind, stage, mb, start, end))

    @contextmanager
    def record(self, kind: str, stage: int, mb: int):
        t0 = self.clock.stamp()
        try:
            yield
        finally:
            self.spans.append((kind, stage, mb, t0, self.clock.stamp()))

    def timeline(self) -> Timeline:
        """The step's timeline in host seconds (the start and end stamps default to the first and last event's)."""
        start = self.start if self.start is not None else self.spans[0][3] if self.spans else self.now()
        end = self.end if self.end is not None else self.spans[-1][4] if self.spans else start
        stamps = [start, end] + [s for *_, a, b in self.spans for s in (a, b)]
        seconds = self.clock.seconds(stamps)
        events = [Event(kind, stage, mb, seconds[2 + 2 * i], seconds[3 + 2 * i])
                  for i, (kind, stage, mb, _, _) in enumerate(self.spans)]
        return Timeline(self.rank, events, self.peak_live, seconds[0], seconds[1])


def bubble_fraction(timelines: Sequence[Timeline]) -> float:
    """Measured idle fraction of a step over all ranks: ``1 - sum(busy) / (p * span)``, where the span
    runs from the first rank's step start to the last rank's step end."""
    t0 = min(t.start for t in timelines)
    t1 = max(t.end for t in timelines)
    if t1 <= t0:
        return 0.0
    return 1.0 - sum(t.busy() for t in timelines) / (len(timelines) * (t1 - t0))


def replayed_bubble(timelines: Sequence[Timeline], actions: list[list[Action]]) -> tuple[float, float]:
    """``(bubble, makespan)`` of the schedule ``actions`` (every rank's list, :func:`build_schedule`)
    replayed with the compute times these timelines measured and free communication
    (:func:`~shardwise.parallel.pipeline.schedules.simulate`).

    It splits the measured bubble in two: ``replayed - theoretical`` is the idle time the schedule
    itself has with these stages' unequal computations (an embedding or a loss on one stage, one
    micro-batch slower than another), which the formula's equal stages leave out; ``measured - replayed``
    is what executing it costs -- transfers, waiting on the transport, the executor's own Python.
    ``makespan`` is the shortest step any executor of this schedule could take with these computations."""
    p = len(timelines)
    durations = {(t.rank, e.kind, e.stage // p, e.mb): e.end - e.start
                 for t in timelines for e in t.events if e.kind in COMPUTE}
    makespan, spans = simulate(actions, durations=durations)
    if makespan <= 0:
        return 0.0, 0.0
    busy = sum(end - start for rank_spans in spans for *_, start, end in rank_spans)
    return 1.0 - busy / (p * makespan), makespan


def gather_timelines(timeline: Timeline, group=None) -> list[Timeline]:
    """All pipeline ranks' timelines on every rank of ``group`` (the pipeline's group)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, timeline, group=group)
    return out


def chrome_trace(timelines: Sequence[Timeline]) -> dict:
    """A Trace Event Format object: one process row per pipeline rank, times in microseconds."""
    t0 = min(t.start for t in timelines)
    events = []
    for t in timelines:
        events.append({"name": "process_name", "ph": "M", "pid": t.rank, "args": {"name": f"stage rank {t.rank}"}})
        for e in t.events:
            events.append({
                "name": f"{e.kind}{e.mb}" if e.kind in COMPUTE else f"{e.kind} mb{e.mb}",
                "cat": e.kind, "ph": "X", "pid": t.rank, "tid": 0 if e.kind in COMPUTE else 1,
                "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6,
                "args": {"stage": e.stage, "microbatch": e.mb},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timelines: Sequence[Timeline], path: str | Path) -> Path:
    """Write :func:`chrome_trace` as JSON (open in chrome://tracing or ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timelines)))
    return path


def plot_gantt(timelines: Sequence[Timeline], path: str | Path, title: str | None = None) -> Path:
    """Gantt chart PNG, one row per pipeline rank: forward blue, backward green, weight gradients
    orange, waits grey hatched; each box is labelled with its micro-batch (a prime, and a lighter
    shade, for a rank's second chunk of an interleaved schedule; ``c<k>`` for later chunks).
    The measured bubble goes in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = min(t.start for t in timelines)
    span = max(t.end for t in timelines) - t0
    colours = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(timelines) + 1.2))
    for t in timelines:
        y = t.rank
        for e in t.events:
            x, w = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
            if e.kind in COMPUTE:
                chunk = (e.stage - t.rank) // len(timelines)  # stage = chunk * p + rank
                ax.barh(y, w, left=x, height=0.8, color=colours[e.kind], edgecolor="black", linewidth=0.3,
                        alpha=1.0 if chunk % 2 == 0 else 0.6)
                if w > span * 1e3 / 80:
                    label = str(e.mb) if chunk == 0 else f"{e.mb}'" if chunk == 1 else f"{e.mb}c{chunk}"
                    ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=7, color="white")
            elif e.kind == "wait":
                ax.barh(y, w, left=x, height=0.3, color="#bbbbbb", hatch="//", linewidth=0)
    ax.set_yticks([t.rank for t in timelines], [f"rank {t.rank}" for t in timelines])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    measured = bubble_fraction(timelines)
    ax.set_title((title + " -- " if title else "") + f"measured bubble {measured:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timelines_from_json(doc: dict) -> list[Timeline]:
    """The timelines a run kept in ``timeline.json``
    (:meth:`shardwise.train.schedules.PipelineSchedule.write_timeline`)."""
    out = []
    for t in doc["timelines"]:
        events = [Event(**e) for e in t["events"]]
        out.append(Timeline(rank=t["rank"], events=events, peak_live=t["peak_live"], start=t["start"], end=t["end"]))
    return out
