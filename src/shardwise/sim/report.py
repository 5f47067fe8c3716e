"""A simulated step as text, as a Chrome trace (Perfetto) and as a picture.

The trace follows the Trace Event Format (complete "X" events, microseconds; process and thread names as
"M" metadata events; https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), one
process per simulated rank (each stands for its tensor-, context- and data-parallel peers) and one thread
per stream, so ``ui.perfetto.dev`` or ``chrome://tracing`` shows it as it would a profiled run.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.sim import exposure
from shardwise.sim.simulate import SimResult
from shardwise.sim.tasks import COMPUTE

STREAMS = ("compute", "tp", "cp", "ep", "pp", "dp", "sync")
AXIS_NAMES = {"dp_cp": "dp", "edp": "dp"}
COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "optimizer": "#8172b3", "tp": "#c44e52",
           "cp": "#937860", "ep": "#da8bc3", "pp": "#8c8c8c", "dp": "#ccb974", "sync": "#64b5cd"}


def axis_name(axis: str | None) -> str | None:
    return AXIS_NAMES.get(axis, axis) if axis else axis


def chrome_trace(res: SimResult, steps: int = 1) -> dict:
    """Every task of ``steps`` identical steps (the engine does not overlap one step with the next)."""
    p = res.cfg.parallel
    stride = p.dp * p.cp * p.tp
    events: list[dict] = []
    tids = {s: i for i, s in enumerate(STREAMS)}
    for r in range(res.graph.n_ranks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {
            "name": f"pp rank {r} (global rank {r * stride}; stands for {stride} ranks)"}})
        for s, i in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": i, "args": {"name": s}})
    for k in range(steps):
        shift = k * res.step_time_s
        for t in res.graph.tasks:
            for r in t.ranks:
                if t.stream == COMPUTE and t.segments:
                    clock = t.start
                    for label, axis, seconds in t.segments:
                        if seconds > 0:
                            events.append(_event(f"{t.name}: {label}" if axis else t.name,
                                                 axis_name(axis) or t.kind, r, tids[COMPUTE], clock + shift, seconds,
                                                 {"step": k, **t.args}))
                        clock += seconds
                elif t.duration > 0:
                    tid = tids.get(axis_name(t.stream), tids["sync"])
                    events.append(_event(t.name, axis_name(t.axis) or t.kind, r, tid, t.start + shift, t.duration,
                                         {"step": k, "bytes": t.nbytes, **t.args}))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"simulated": True, **{k: str(v) for k, v in res.summary().items() if k != "ranks"}}}


def _event(name: str, cat: str, pid: int, tid: int, start: float, seconds: float, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": start * 1e6, "dur": seconds * 1e6,
            "args": args}


def write_trace(res: SimResult, path: str | Path, steps: int = 1) -> Path:
    """Write :func:`chrome_trace` as JSON, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(res, steps)))
    tmp.replace(path)
    return path


def plot(res: SimResult, path: str | Path, max_ranks: int = 8, title: str | None = None) -> Path:
    """A Gantt chart of the busiest simulated ranks: computation and blocking collectives on one row per
    rank, the overlapped communication streams in a thin row beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = sorted(res.ranks, key=lambda r: -r.busy_s)[:max_ranks]
    ranks.sort(key=lambda r: r.rank)
    scale, unit = (1e3, "ms") if res.step_time_s < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(11, 0.75 * len(ranks) + 1.5))
    for row, rr in enumerate(ranks):
        for t in res.graph.rank_tasks(rr.rank):
            if t.stream == COMPUTE:
                clock = t.start
                for label, axis, seconds in t.segments or ((t.kind, axis_name(t.axis), t.duration),):
                    key = axis_name(axis) or ("optimizer" if t.kind == "opt" else label if label in COLOURS else t.kind)
                    ax.barh(row, seconds * scale, left=clock * scale, height=0.6,
                            color=COLOURS.get(key, "#999999"), linewidth=0)
                    clock += seconds
            elif t.duration > 0:
                ax.barh(row + 0.42, t.duration * scale, left=t.start * scale, height=0.18,
                        color=COLOURS.get(axis_name(t.axis), "#999999"), linewidth=0)
    ax.set_yticks(range(len(ranks)), [f"pp rank {r.rank}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in COLOURS.items()]
    ax.legend(handles=handles, ncol=len(handles), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    s = res.summary()
    bubble = f", bubble {s['bubble']:.1%}" if s["bubble"] is not None else ""
    ax.set_title((title + ": " if title else "") + f"simulated step {res.step_time_s * scale:.4g} {unit}, "
                 f"MFU {res.mfu:.1%}{bubble}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def text(res: SimResult, failures: dict | None = None, max_ranks: int = 8) -> list[str]:
    """The human summary: the step, where its exposed communication goes, memory (loudly when it does not fit)."""
    s = res.summary()
    lay = s["layout"]
    hw = res.hw
    layout = " ".join(f"{k}{lay[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if lay[k] > 1 or k == "dp")
    if lay["zero"]:
        layout += f" zero{lay['zero']}"
    if lay["pp_schedule"]:
        layout += f" {lay['pp_schedule']}" + (f" v{lay['pp_virtual']}" if lay["pp_virtual"] > 1 else "")
    causal = f"; causal count 6N + 6·L·h·s: {res.mfu_causal:.1%}" if res.mfu_causal is not None else ""
    out = [f"{res.cfg.model.preset} on {hw.world} x {hw.gpu.name} ({hw.nodes} node(s) x {hw.gpus_per_node}): "
           f"{layout}, {lay['microbatches']} micro-batch(es) of {lay['micro_batch']}"]
    if not res.fits:
        out.append(_does_not_fit(res))
    out += [f"step {res.step_time_s:.4g} s   {res.tokens_per_s:,.0f} tokens/s   MFU {res.mfu:.1%}"
            + (f"   bubble {res.bubble:.1%}" if res.bubble is not None else ""),
            f"  MFU counts PaLM's 6N + 12·L·h·s FLOPs per token (full attention, no recomputation){causal}",
            "exposed communication (s, busiest rank): " + (", ".join(
                f"{axis_name(k)} {v:.4g}" for k, v in sorted(_merged(s["exposed_comm_s"]).items())) or "none")]
    out += exposure.text(res)
    out += _memory_lines(res, max_ranks)
    out.append(f"simulated {s['simulated_tasks']} tasks of {res.graph.n_ranks} rank(s) standing for {hw.world} in "
               f"{res.wall_s:.2f} s")
    if failures:
        out += [f"failures: job MTBF {failures['job_mtbf_h']:.3g} h ({failures['mtbf_per_gpu_h']:.3g} h per GPU), "
                f"checkpoint write {failures['checkpoint_write_s']:.3g} s, restart {failures['restart_s']:.3g} s",
                f"  Young/Daly interval {failures['interval_s']:.4g} s -> ckpt.every = {failures['ckpt_every']} steps; "
                f"expected goodput {failures['goodput']:.1%}"]
    if not res.fits:
        out.append(_does_not_fit(res))
    return out


def _does_not_fit(res: SimResult) -> str:
    worst = max(res.ranks, key=lambda r: r.peak_bytes)
    return (f"!! DOES NOT FIT: pipeline rank {worst.rank} needs {worst.peak_bytes / 1e9:.1f} GB, the "
            f"{res.hw.gpu.name} has {res.hw.gpu.memory_bytes / 1e9:.0f} GB -- this layout would run out of memory; "
            "its step time is hypothetical")


def _memory_lines(res: SimResult, max_ranks: int) -> list[str]:
    """Peak memory, the busiest rank first; every simulated pipeline rank up to ``max_ranks``, then how many
    are left out (each stands for its dp x cp x tp peers, alike)."""
    hw, p = res.hw, res.cfg.parallel
    alike = p.dp * p.cp * p.tp
    line = f"peak memory per rank: {res.peak_bytes / 1e9:.2f} GB (of {hw.gpu.memory_bytes / 1e9:.0f} GB)"
    if len(res.ranks) > 1:
        shown = res.ranks[:max_ranks]
        line += "; pipeline rank " + "; ".join(f"{r.rank} {r.peak_bytes / 1e9:.2f}" for r in shown)
        left = len(res.ranks) - len(shown)
        if left:
            line += (f"; ... {left} more pipeline ranks not listed ({left * alike:,} ranks; --json lists every "
                     "pipeline rank)")
    if alike > 1:
        line += f"; each pipeline rank stands for {alike:,} ranks alike (its dp x cp x tp peers)"
    return [line]


def _merged(exposed: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in exposed.items():
        out[axis_name(k)] = out.get(axis_name(k), 0.0) + v
    return out
