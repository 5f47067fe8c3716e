"""The step as tasks on streams, and the clock that runs them.

Every simulated rank has streams as a GPU has (Nickolls et al. 2008, "Scalable parallel programming with
CUDA"; NCCL runs each communicator's collectives on a stream of its own): one for computation and one per
communication group (``dp``, ``pp``, ``tp``, ``cp``, ``ep``, ``sync``). A stream runs its tasks one at a time
in the order they were issued; a task also waits for the tasks it depends on (a receive for its send, the
gradient all-reduce of a bucket for the backward that filled it, the next forward for a ZeRO-3 gather). A
collective over several simulated ranks (the loss or gradient-norm all-reduce of a pipeline) is one task
on every participating rank's stream, so it starts when the last of them arrives -- a synchronisation.
Durations are fixed before the run (the network has been solved per collective), so the schedule is the
longest path of a DAG: every task starts when its stream predecessor and its dependencies have ended.

A compute task may hold *segments*: the blocking collectives inside a forward or backward (tensor
parallelism's all-reduces, an expert all-to-all, the exposed part of a context-parallel ring) in the order
they run, so that the trace and the exposed communication per axis show them.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from dataclasses import dataclass, field

COMPUTE = "compute"


@dataclass(eq=False)
class Task:
    """One thing a stream does: ``kind`` F / B / W / embed ... for compute, a collective's name otherwise."""

    name: str
    kind: str
    ranks: tuple[int, ...]
    stream: str
    duration: float
    deps: list[Task] = field(default_factory=list)
    axis: str | None = None
    """The mesh axis of a communication task (``None``: computation)."""
    segments: tuple[tuple[str, str | None, float], ...] = ()
    """``(label, axis, seconds)`` inside a compute task: axis ``None`` computes, an axis communicates."""
    nbytes: float = 0.0
    start: float = float("nan")
    end: float = float("nan")
    args: dict = field(default_factory=dict)

    def comm_seconds(self) -> dict[str, float]:
        """Seconds of each axis's blocking collectives inside this task."""
        out: dict[str, float] = defaultdict(float)
        for _, axis, seconds in self.segments:
            if axis is not None:
                out[axis] += seconds
        return out


class Graph:
    """Every task of one step, by rank and stream, in issue order."""

    def __init__(self, n_ranks: int):
        self.n_ranks = n_ranks
        self.streams: dict[tuple[int, str], list[Task]] = defaultdict(list)
        self.tasks: list[Task] = []
        self._by_rank: dict[int, list[Task]] | None = None

    def add(self, task: Task) -> Task:
        for r in task.ranks:
            self.streams[(r, task.stream)].append(task)
        self.tasks.append(task)
        self._by_rank = None
        return task

    def run(self, start: float = 0.0) -> float:
        """Give every task its start and end (seconds from ``start``); the step's end. Raises RuntimeError
        naming a stuck task if dependencies form a cycle (a schedule that would deadlock)."""
        preds: dict[int, set[int]] = {id(t): {id(d) for d in t.deps} for t in self.tasks}
        for queue in self.streams.values():
            for a, b in zip(queue, queue[1:], strict=False):
                preds[id(b)].add(id(a))
        by_id = {id(t): t for t in self.tasks}
        succ: dict[int, list[int]] = defaultdict(list)
        for tid, ps in preds.items():
            for p in ps:
                succ[p].append(tid)
        waiting = {tid: len(ps) for tid, ps in preds.items()}
        ready = deque(tid for tid, n in waiting.items() if n == 0)
        done = 0
        while ready:
            tid = ready.popleft()
            t = by_id[tid]
            t.start = max([start] + [by_id[p].end for p in preds[tid]])
            t.end = t.start + t.duration
            done += 1
            for s in succ[tid]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    ready.append(s)
        if done < len(self.tasks):
            stuck = next(t for t in self.tasks if t.end != t.end)
            raise RuntimeError(f"the step's tasks wait on each other in a cycle (e.g. {stuck.name} on rank "
                               f"{stuck.ranks}): the schedule would deadlock")
        return max((t.end for t in self.tasks), default=start)

    def rank_tasks(self, rank: int) -> list[Task]:
        """Every task of ``rank`` (all its streams), in issue order."""
        if self._by_rank is None:
            self._by_rank = defaultdict(list)
            for t in self.tasks:
                for r in t.ranks:
                    self._by_rank[r].append(t)
        return self._by_rank[rank]


def busy_intervals(tasks: list[Task]) -> list[tuple[float, float]]:
    """The merged intervals in which a rank computes (its compute tasks' compute segments)."""
    spans = []
    for t in tasks:
        if t.stream != COMPUTE:
            continue
        clock = t.start
        for _, axis, seconds in t.segments or ((t.kind, t.axis, t.duration),):
            if axis is None and seconds > 0:
                spans.append((clock, clock + seconds))
            clock += seconds
    spans.sort()
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def exposed_comm(tasks: list[Task]) -> dict[str, float]:
    """Seconds of each axis's communication during which the rank does not compute: blocking segments in
    full, and the parts of the communication streams' tasks that no compute interval covers."""
    busy = busy_intervals(tasks)
    starts = [a for a, _ in busy]
    before = [0.0]  # busy time before each interval's start
    for a, b in busy:
        before.append(before[-1] + b - a)

    def busy_until(x: float) -> float:
        i = bisect.bisect_right(starts, x)
        if i == 0:
            return 0.0
        a, b = busy[i - 1]
        return before[i - 1] + min(x, b) - a

    out: dict[str, float] = defaultdict(float)
    for t in tasks:
        if t.stream == COMPUTE:  # blocking: segments inside a computation, or a collective the compute waits for
            for axis, seconds in t.comm_seconds().items():
                out[axis] += seconds
            if t.axis is not None and not t.segments:
                out[t.axis] += t.duration
        elif t.axis is not None and t.duration > 0:
            out[t.axis] += t.duration - (busy_until(t.end) - busy_until(t.start))
    return dict(out)
