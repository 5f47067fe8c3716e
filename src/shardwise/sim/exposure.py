"""Where the time goes: every exposed piece of communication of a simulated step, why it is exposed, and which
known overlap would hide it.

A collective is *exposed* where the rank it runs on does not compute meanwhile (:func:`shardwise.sim.tasks.
exposed_comm`). It is exposed in one of three ways, read off the task graph:

* ``blocking`` -- the engine calls it on the compute stream and waits (ZeRO-1/2's gather of the updated weights
  after the optimizer step, the gradient norm's all-reduce, hardware that cannot overlap): all of it;
* ``inside`` -- a segment of a forward or backward (tensor parallelism's all-reduces, an expert all-to-all, what a
  context-parallel ring transfer takes beyond its block pair): all of it;
* ``tail`` -- on a stream of its own, but the computation it could hide behind ran out before it ended (the last
  gradient buckets after the backward, a ZeRO-3 gather longer than the unit before it, a pipeline send the next
  stage waits for): the part no computation covers.

For each piece the analysis names what it waited for before it could start (the dependency that ended last, or
the collective queued before it on its stream), what waited for it (the computation that depends on it), and --
from :data:`RULES`, one per kind of collective the step builder issues -- the overlap that Megatron-Core,
PyTorch or the papers use to hide it, where one is known (the overlaps of Megatron-Core's ``--overlap-grad-reduce``,
``--overlap-param-gather`` and ``--tp-comm-overlap``; Wang et al. 2022, "Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models", ASPLOS'23, for the last).

Pieces of one kind (all the buckets of one gather, the tensor-parallel all-reduces of every forward) are summed
into one line per axis, for the simulated rank where that axis's exposed time is largest -- the figure the
summary prints per axis.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

from shardwise.sim.tasks import COMPUTE, Task, busy_intervals

HOW = ("blocking", "inside", "tail")


@dataclass
class Exposed:
    """One exposed piece of communication on one simulated rank."""

    rank: int
    axis: str
    name: str
    """The collective (a task's name, or a segment's label)."""
    seconds: float
    """Exposed seconds (the whole collective for ``blocking`` and ``inside``)."""
    duration: float
    nbytes: float
    how: str
    """``blocking``, ``inside`` or ``tail`` (see the module docstring)."""
    inside: str | None = None
    """The computation holding an ``inside`` segment."""
    after: str | None = None
    """What it waited for before it could start."""
    waited_by: str | None = None
    """The computation that waited for it."""
    hidden_by: str | None = None
    """A known overlap that would hide it, or why none applies."""
    first_use: float = 0.0
    """Where in the next forward its parameters are first needed (ZeRO-1/2's gathers; smaller is earlier)."""


@dataclass
class Cause:
    """Exposed pieces of one kind on one rank, summed."""

    axis: str
    what: str
    """The collective(s), e.g. ``all-gather bucket 0..11``."""
    calls: int
    exposed_s: float
    bytes: float
    how: str
    after: str | None
    waited_by: str | None
    hidden_by: str | None
    rank: int

    def line(self) -> str:
        size = f", {self.bytes / 1e9:.3g} GB" if self.bytes >= 1e6 else ""
        calls = f" ({self.calls} calls{size})" if self.calls > 1 else (f" ({self.bytes / 1e9:.3g} GB)" if size else "")
        how = {"blocking": "called on the compute stream", "inside": "blocking inside the computation",
               "tail": "on its own stream, past the computation it could hide behind"}[self.how]
        parts = [f"{self.exposed_s:.4g} s  {self.what}{calls}: {how}"]
        if self.after:
            parts.append(f"after {self.after}")
        if self.waited_by:
            parts.append(f"waited for by {self.waited_by}")
        text = "; ".join(parts)
        return text + (f" -> {self.hidden_by}" if self.hidden_by else "")


# ---- naming the computations -------------------------------------------------------------------------------

_PHASE = {"F": "forward", "B": "backward", "W": "weight-gradient pass"}


def describe(task: Task | None) -> str | None:
    """A computation in words: ``forward of micro-batch 0, layer 3``, ``backward of micro-batch 2, stage 5``."""
    if task is None:
        return None
    if task.kind in _PHASE:
        mb = task.args.get("mb")
        text = f"{_PHASE[task.kind]} of micro-batch {mb}"
        if "stage" in task.args:
            return text + f", stage {task.args['stage']}"
        piece = task.name.split(" ", 1)[1] if " " in task.name else ""
        return text + (f", layer {piece}" if piece.isdigit() else f", {piece}" if piece else "")
    if task.kind == "opt":
        return "the optimizer step"
    return task.name


# ---- known overlaps ----------------------------------------------------------------------------------------

Hint = Callable[["Exposed", object], "str | None"]
"""``hint(piece, result) -> text``: the known overlap for a piece (``result``: the :class:`SimResult`)."""


def _zero_gather(piece: Exposed, res) -> str | None:
    if piece.how == "blocking":
        return ("would be hidden by an overlapped parameter all-gather: each bucket gathered behind the next "
                "step's forward, in forward order, each piece waiting only for its own bucket "
                "(parallel.zero_overlap_param_gather true; Megatron-Core --overlap-param-gather)")
    return "already overlapped with the next forward; exposed where less forward precedes the bucket's first use"


def _bucket(piece: Exposed, res) -> str | None:
    p, hw = res.cfg.parallel, res.hw
    if p.pp > 1 and p.zero in (1, 2) and not p.zero_overlap_grad_reduce:
        return ("would be hidden by reducing each bucket as soon as the last micro-batch's backward has filled it, "
                "inside the pipeline's cool-down (Megatron-Core --overlap-grad-reduce with a pipeline): "
                "parallel.zero_overlap_grad_reduce true does; plain data parallelism always does")
    if p.pp > 1 and p.pp_schedule == "zb-h1":
        return ("none inside zb-h1, whose W passes accumulate the weight gradients after the last backward: the "
                "buckets are reduced after the flush (1F1B, GPipe and interleaved reduce in the cool-down)")
    if p.pp > 1 and res.cfg.model.tie_embeddings:
        return ("the tied table's bucket, and every bucket after it, waits for the flush (its two copies add their "
                "gradients there): untied embeddings (model.tie_embeddings false) or a smaller last bucket "
                "(parallel.bucket_mb) leave less after the last backward")
    if piece.how == "blocking" and not hw.overlap:
        return "none on this hardware: its collectives take the cores that compute (sim.overlap = false)"
    if p.zero in (1, 2) and not p.zero_overlap_grad_reduce:
        return ("would be hidden by launching it during the backward and waiting at the end "
                "(parallel.zero_overlap_grad_reduce true)")
    return ("the last buckets to fill have no backward left to hide behind: a smaller last bucket "
            "(parallel.bucket_mb) or a 16-bit reduction (parallel.grad_reduce_dtype bf16, as FSDP2's reduce_dtype) "
            "shortens them")


def _unit_gather(piece: Exposed, res) -> str | None:
    if piece.name.startswith("gather root"):
        return "the root unit is gathered before the first forward: nothing precedes it to hide behind"
    return ("prefetched during the unit before it, whose computation is shorter than the gather: larger units "
            "(parallel.zero_unit) or hpZ's node-local gathers in backward (parallel.zero_hpz) shorten it")


def _unit_reduce(piece: Exposed, res) -> str | None:
    if res.hw.backend == "gloo":
        return "would be hidden by waiting at the end of the backward instead of at once (the engine's CPU path)"
    return "the first units' gradients are complete only at the end of the backward: nothing left to hide behind"


def _tp(piece: Exposed, res) -> str | None:
    if "grad sync" in piece.name:
        return ("would be hidden by summing the whole-kept parameters' gradients in one bucket on the "
                "data-parallel stream during backward (Korthikanti et al. 2022 §4.2.2 reduce them once)")
    if "loss" in piece.name:
        return "three values per token: no overlap needed beyond fusing the three calls"
    sp = "" if res.cfg.parallel.sequence_parallel else " (with sequence parallelism, which splits them into " \
                                                        "all-gather and reduce-scatter)"
    return ("would be hidden by tensor-parallel communication overlap: the all-gather before and the reduce-scatter "
            "after each GEMM cut into chunks, chunk k's transfer beside chunk k-1's product (Wang et al. 2022; "
            "parallel.tp_comm_overlap true; Megatron-Core --tp-comm-overlap)" + sp)


def _pp(piece: Exposed, res) -> str | None:
    if "send" in piece.name:
        return ("the receiving stage waits for it: a transfer on the pipeline's critical path (fewer, larger "
                "stages or 16-bit activations make it shorter; interleaving adds more of them)")
    if "tied" in piece.name:
        return "the tied tables' gradient exchange after the flush (untied embeddings avoid it)"
    return "a synchronisation of every stage after the flush: no overlap"


def _cp(piece: Exposed, res) -> str | None:
    if "ring" in piece.name:
        return ("the K/V transfer outlasts its block pair's attention: longer sequences per rank or fewer cp ranks "
                "hide it")
    return "blocking around the attention core: no overlap in the engine"


def _ep(piece: Exposed, res) -> str | None:
    return ("blocking around the experts: would be hidden by overlapping one micro-batch's dispatch with another's "
            "computation (DeepSeek-V3's DualPipe, §3.2.1); not in the engine")


def _sync(piece: Exposed, res) -> str | None:
    return "a scalar synchronisation every rank takes part in: no overlap"


def _offload(piece: Exposed, res) -> str | None:
    return "host-device copies of ZeRO-Offload: hidden only where the host optimizer step is shorter"


RULES: tuple[tuple[str, Hint], ...] = (
    (r"^all-gather bucket \d+", _zero_gather),
    (r"^(all-reduce|reduce-scatter) bucket \d+", _bucket),
    (r"^gather (root|u\d+)", _unit_gather),
    (r"^reduce-scatter u\d+", _unit_reduce),
    (r"^(tp |sp |embedding |head |vocab-parallel loss|etp )", _tp),
    (r"^(send_f|send_b|tied grads|pipeline loss|timeline gather)", _pp),
    (r"^cp ", _cp),
    (r"^ep all-to-all", _ep),
    (r"^(grad norm all-reduce|grad flags all-reduce|loss all-reduce)", _sync),
    (r"gradient to host|weights to the device", _offload),
)
"""Name pattern of a collective the step builder issues -> its known overlap. A collective that matches none is
reported with ``hidden_by`` = "unclassified: no rule in sim/exposure.py RULES" (tests require none)."""

UNCLASSIFIED = "unclassified: no rule in sim/exposure.py RULES"


def hint_for(piece: Exposed, res) -> str:
    for pattern, hint in RULES:
        if re.search(pattern, piece.name):
            return hint(piece, res) or UNCLASSIFIED
    return UNCLASSIFIED


# ---- the analysis ------------------------------------------------------------------------------------------


def _covered(busy: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in busy if hi > a and lo < b)


def exposed_pieces(res, rank: int) -> list[Exposed]:
    """Every exposed piece of communication of simulated rank ``rank`` (its seconds sum, per axis, to
    ``res.ranks[rank].exposed_s``)."""
    graph = res.graph
    tasks = graph.rank_tasks(rank)
    busy = busy_intervals(tasks)
    waiters: dict[int, list[Task]] = {}
    for t in graph.tasks:
        for d in t.deps:
            waiters.setdefault(id(d), []).append(t)
    compute = [t for t in tasks if t.stream == COMPUTE]
    position = {id(t): i for i, t in enumerate(compute)}
    out: list[Exposed] = []
    for t in tasks:
        if t.stream == COMPUTE and t.segments:
            for label, axis, seconds in t.segments:
                if axis is not None and seconds > 0:
                    out.append(Exposed(rank, axis, label, seconds, seconds, 0.0, "inside", describe(t)))
        if t.axis is None or t.duration <= 0:
            continue
        if t.stream == COMPUTE and not t.segments:
            i = position[id(t)]
            before = next((c for c in reversed(compute[:i]) if c.axis is None and c.kind != "wait"), None)
            out.append(Exposed(rank, t.axis, t.name, t.duration, t.duration, t.nbytes, "blocking",
                               after=describe(before), waited_by="the compute stream (a synchronous call)"))
        elif t.stream != COMPUTE:
            seconds = t.duration - _covered(busy, t.start, t.end)
            if seconds <= 1e-15:
                continue
            out.append(Exposed(rank, t.axis, t.name, seconds, t.duration, t.nbytes, "tail",
                               after=_after(t, graph), waited_by=_waiter(t, waiters, compute, position, rank)))
    for piece in out:
        piece.hidden_by = hint_for(piece, res)
        if piece.name.startswith("all-gather bucket") and res.builder is not None:
            piece.waited_by, piece.first_use = _first_use(res, rank, piece.name)
    return out


def _after(t: Task, graph) -> str | None:
    """The dependency (or the collective queued before it on its stream) that ended last."""
    candidates = list(t.deps)
    queue = graph.streams.get((t.ranks[0], t.stream), [])
    i = next((k for k, q in enumerate(queue) if q is t), None)
    if i:
        candidates.append(queue[i - 1])
    last = max(candidates, key=lambda d: d.end, default=None)
    if last is None:
        return None
    if last.stream == t.stream and last.axis is not None and last not in t.deps:
        return f"{last.name} (queued behind it on the {t.stream} stream)"
    return describe(last)


def _waiter(t: Task, waiters: dict, compute: list[Task], position: dict, rank: int) -> str | None:
    """The first computation (on ``rank``, else on another simulated rank) that depends on ``t``; a zero-length wait
    is followed to the computation after it."""
    mine = [w for w in waiters.get(id(t), []) if rank in w.ranks and w.stream == COMPUTE]
    if mine:
        w = min(mine, key=lambda x: x.start)
        if w.kind == "wait":
            i = position[id(w)]
            nxt = next((c for c in compute[i + 1:] if c.kind != "wait"), None)
            return f"'{w.name}'" + (f" before {describe(nxt)}" if nxt is not None else "")
        return describe(w)
    other = [w for w in waiters.get(id(t), []) if w.stream == COMPUTE]
    if other:
        w = min(other, key=lambda x: x.start)
        return f"pipeline rank {w.ranks[0]}'s {describe(w)}"
    return None


def _first_use(res, rank: int, name: str) -> tuple[str, float]:
    """The next step's first computation that needs the parameters of bucket ``name`` (ZeRO-1/2's gathers), and
    its place in forward order."""
    from shardwise.sim.params import EMBED, HEAD

    i = int(name.split()[2])
    rp = res.builder.params[rank]
    pieces = {rp.pieces[j] for j in rp.groups[i]}
    order = [EMBED] + sorted(pc for pc in pieces if isinstance(pc, int)) + [HEAD]
    first = next(pc for pc in order if pc in pieces)
    label = f"layer {first}" if isinstance(first, int) else ("the embedding" if first == EMBED else "the head")
    place = -1.0 if first == EMBED else float("inf") if first == HEAD else float(first)
    return f"the next step's forward of {label}", place


def _template(name: str) -> str:
    return re.sub(r"\d+", "#", name)


def causes(res, rank: int | None = None) -> list[Cause]:
    """The exposed pieces of ``rank`` (default: for each axis the rank where it is largest) grouped by kind,
    largest first."""
    ranks = range(res.graph.n_ranks)
    if rank is None:
        best: dict[str, int] = {}
        for r in res.ranks:
            for axis, s in r.exposed_s.items():
                if axis not in best or s > res.ranks[best[axis]].exposed_s.get(axis, 0.0):
                    best[axis] = r.rank
        pieces = [p for r in sorted(set(best.values())) for p in exposed_pieces(res, r) if best.get(p.axis) == r]
    else:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a simulated rank (0..{res.graph.n_ranks - 1})")
        pieces = exposed_pieces(res, rank)
    groups: dict[tuple, list[Exposed]] = {}
    for p in pieces:
        key = (p.rank, p.axis, _template(p.name), p.how, p.hidden_by)
        groups.setdefault(key, []).append(p)
    out = []
    for (r, axis, _, how, hidden), ps in groups.items():
        names = [p.name for p in ps]
        what = names[0]
        if len(set(names)) > 1:
            what = _range(names)
        if how == "inside":
            phases = sorted({(p.inside or "").split(" of ")[0] for p in ps}, key=lambda x: x != "forward")
            what += f" inside every {' and '.join(phases)}" if len(ps) > 1 else f" inside the {ps[0].inside}"
        first = min(ps, key=lambda p: p.first_use)  # what the earliest of them holds up
        out.append(Cause(axis, what, len(ps), sum(p.seconds for p in ps), sum(p.nbytes for p in ps), how,
                         ps[0].after, first.waited_by, hidden, r))
    out.sort(key=lambda c: -c.exposed_s)
    return out


def _range(names: list[str]) -> str:
    """``all-gather bucket 0..11`` for names that differ in one number."""
    nums = [re.findall(r"\d+", n) for n in names]
    if all(len(x) == len(nums[0]) for x in nums) and nums[0]:
        vary = [i for i in range(len(nums[0])) if len({x[i] for x in nums}) > 1]
        if len(vary) == 1:
            vals = sorted({int(x[vary[0]]) for x in nums})
            parts = re.split(r"(\d+)", names[0])
            parts[2 * vary[0] + 1] = f"{vals[0]}..{vals[-1]}"
            return "".join(parts)
    return f"{names[0]} .. {names[-1]}"


def text(res, top: int = 4) -> list[str]:
    """Per axis, the largest causes of its exposed time on the rank where it is largest."""
    cs = causes(res)
    if not cs:
        return ["where the time goes: no communication is exposed"]
    lines = ["where the exposed communication goes (per axis, on the simulated rank where it is largest):"]
    by_axis: dict[str, list[Cause]] = {}
    for c in cs:
        by_axis.setdefault(c.axis, []).append(c)
    for axis, items in sorted(by_axis.items(), key=lambda kv: -sum(c.exposed_s for c in kv[1])):
        total = sum(c.exposed_s for c in items)
        lines.append(f"  {axis} {total:.4g} s (pipeline rank {items[0].rank}):")
        lines += [f"    {c.line()}" for c in items[:top]]
        if len(items) > top:
            rest = sum(c.exposed_s for c in items[top:])
            lines.append(f"    ... {len(items) - top} more kinds, {rest:.3g} s (--json lists them all)")
    return lines


def to_json(res) -> list[dict]:
    return [asdict(c) for c in causes(res)]


__all__ = ["Exposed", "Cause", "RULES", "exposed_pieces", "causes", "text", "to_json", "describe", "UNCLASSIFIED"]
