"""Rendering a plan: the human table, the JSON document and the stacked memory bar chart."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shardwise.plan.memory import FLUSH_METRICS, MEMORY_METRICS, MODEL_STATE_METRICS
from shardwise.plan.search import Candidate

SHORT = {"mem_params_bytes": "params", "mem_grads_bytes": "grads", "mem_master_bytes": "master",
         "mem_optimizer_bytes": "optim", "mem_activations_bytes": "activ", "mem_buffers_bytes": "buffers",
         "flush": "flush"}
COLUMNS = (*MEMORY_METRICS, "flush")
"""The table's memory columns; "flush" is what a ZeRO-2/3 pipeline step holds until its flush
(:data:`~shardwise.plan.memory.FLUSH_METRICS`: the gathered stage, the unsharded gradients)."""


def memory_columns(by_metric: dict[str, float]) -> dict[str, float]:
    """The device memory by table column."""
    return {**{k: by_metric[k] for k in MEMORY_METRICS}, "flush": sum(by_metric.get(k, 0.0) for k in FLUSH_METRICS)}


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def human(x: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def model_state_total(by_metric: dict[str, float]) -> float:
    """The sum the trainer logs as ``mem_total_bytes``: model states only."""
    return sum(by_metric[k] for k in MODEL_STATE_METRICS)


def candidate_dict(c: Candidate) -> dict[str, Any]:
    t = c.time
    return {
        "layout": dataclasses.asdict(c.layout) | {"short": c.layout.short()},
        "memory": c.memory.by_metric("device") | {"mem_total_bytes": model_state_total(c.memory.by_metric("device")),
                                                  "mem_device_bytes": c.mem_bytes},
        "memory_host": c.memory.by_metric("host"),
        "memory_disk": c.memory.by_metric("disk"),
        "memory_lines": [dataclasses.asdict(line) for line in c.memory.lines],
        "time": {"step_time_s": t.step_time_s, "tokens_per_s": t.tokens_per_s, "mfu": t.mfu,
                 "compute_s": t.compute_s, "bubble_s": t.bubble_s, "bubble_fraction": t.bubble_fraction,
                 "comm_exposed_s": t.comm_exposed_s, "offload_s": t.offload_s, "sync_s": t.sync_s,
                 "collectives_per_step": t.collectives_per_step,
                 "flops_per_token": t.flops_per_token, "hardware_flops_per_token": t.hardware_flops_per_token,
                 "comm_bytes": t.comm_bytes, "comm_sent_bytes": t.comm_sent_bytes},
        "comm": [{"technique": i.technique, "collective": i.collective, "group": i.group, "payload_bytes": i.payload,
                  "calls": i.calls, "sent_bytes": i.sent_bytes, "time_s": i.time_s, "overlaps_with": i.overlap}
                 for i in t.comm],
    }


def layouts_table(cands: list[Candidate]) -> list[str]:
    head = (f"{'#':>2}  {'layout':<44} {'mem GB':>7} " + " ".join(f"{SHORT[k]:>7}" for k in COLUMNS)
            + f" {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'bubble':>6} {'sent GB':>8}")
    lines = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        mem = memory_columns(c.memory.by_metric("device"))
        t = c.time
        lines.append(f"{i:>2}  {c.layout.short():<44} {gb(c.mem_bytes):>7} "
                     + " ".join(f"{gb(mem[k]):>7}" for k in COLUMNS)
                     + f" {t.step_time_s:>8.4g} {t.tokens_per_s:>10,.0f} {t.mfu:>6.1%} {t.bubble_fraction:>6.1%}"
                     + f" {t.comm_sent_bytes / 1e9:>8.2f}")
    return lines


def does_not_fit(c: Candidate, budget_bytes: float, gpu_bytes: float) -> str:
    return (f"does not fit: needs {gb(c.mem_bytes)} GB of {gb(budget_bytes)} GB "
            f"({budget_bytes / gpu_bytes:.0%} of the GPU's {gpu_bytes / 1e9:.0f} GB)")


def breakdown(c: Candidate, note: str = "") -> list[str]:
    """Every memory line with its formula and source, then the communication and the step time
    (``note``: said after the layout's name, e.g. that it does not fit)."""
    lines = [f"memory per GPU of {c.layout.short()}" + (f" -- {note}:" if note else ":")]
    for line in c.memory.lines:
        where = "" if line.where == "device" else f" [{line.where}]"
        lines.append(f"  {line.name:<22} {gb(line.bytes):>9} GB{where}  {line.formula}  ({line.source})")
    lines.append(f"  {'total on device':<22} {gb(c.mem_bytes):>9} GB")
    t = c.time
    if t.comm:
        lines.append("communication per step (alpha-beta, two-level network):")
        for i in t.comm:
            lines.append(f"  {i.technique:<26} {i.collective:<14} group {i.group:<4} {human(i.payload, 'B'):>9} "
                         f"x {i.calls:<5} sent {human(i.sent_bytes, 'B'):>9}  {i.time_s * 1e3:9.2f} ms  "
                         f"overlaps: {i.overlap}")
    lines.append(f"step time {t.step_time_s:.3f} s = compute {t.compute_s:.3f} + bubble {t.bubble_s:.3f}"
                 f" + exposed comm {t.comm_exposed_s:.3f} + offload {t.offload_s:.3f}"
                 + (f" + sync {t.sync_s:.3f} ({t.collectives_per_step} calls)" if t.sync_s else "") + ";"
                 f" {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%}")
    return lines


def plot_memory(cands: list[Candidate], path: str | Path, title: str = "", capacity: float = 0.0) -> Path:
    """A stacked bar of the device memory categories per layout, with the GPU's capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cands) + 2), 4.5))
    names = [c.layout.short().replace(" ", "\n", 3) for c in cands]
    bottom = [0.0] * len(cands)
    for key in COLUMNS:
        vals = [memory_columns(c.memory.by_metric("device"))[key] / 1e9 for c in cands]
        ax.bar(names, vals, bottom=bottom, label=SHORT[key])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if capacity:
        ax.axhline(capacity / 1e9, color="black", linestyle="--", linewidth=1, label="GPU memory")
    ax.set_ylabel("GB per GPU")
    ax.set_title(title or "predicted memory per GPU")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
