"""Plot training runs from their ``metrics.jsonl`` files into one PNG.

Uses matplotlib's object-oriented API (``matplotlib.figure.Figure`` rendered by the Agg
canvas), so no pyplot state or global backend switch is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shardwise.train.metrics import METRICS_FILE, read_metrics

__all__ = ["plot_runs", "plot_timeline"]

# (metric key, panel title, y label, log-scale y)
_PANELS = (
    ("loss", "training loss", "loss", False),
    ("tokens_per_s", "throughput", "tokens / s", False),
    ("lr", "learning rate", "lr", False),
    ("grad_norm", "gradient norm", "grad norm", True),
)


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Run directory names, or fuller paths where names collide."""
    names = [p.name or str(p) for p in run_dirs]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(run_dirs, names, strict=True)]


def plot_runs(run_dirs: Sequence[Path], out: Path) -> Path:
    """Write a PNG comparing runs: loss (with ``val_loss`` markers), tokens/s, lr, grad norm; and, when a run
    has mixture-of-experts blocks, an expert-load row: tokens per expert (mean, min-max band) and the router's
    load-balancing loss with the dropped fraction, and a heat map of the first such run's load per block,
    expert and step (``moe_load_layer{i}``).

    Each run is one colour across the panels, labelled by its directory name. Raises
    FileNotFoundError naming the run directory if it has no ``metrics.jsonl``, ValueError if
    that file holds no records. Returns ``out``.
    """
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = []
    for run_dir in run_dirs:
        try:
            records = read_metrics(run_dir)
        except FileNotFoundError:
            raise FileNotFoundError(f"{run_dir}: no {METRICS_FILE} found; is this a shardwise run directory?") from None
        if not records:
            raise ValueError(f"{run_dir}: {METRICS_FILE} holds no metrics records")
        runs.append(records)

    moe = any(_series(r, "moe_tokens_per_expert_mean")[0] for r in runs)
    heat = next(((records, label) for records, label in zip(runs, _labels(run_dirs), strict=True)
                 if _load_layers(records)), None)
    rows = 3 if moe else 2
    fig = Figure(figsize=(12, 4 * (rows + (heat is not None))), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows + (heat is not None), 2)
    axes = [fig.add_subplot(grid[r, c]) for r in range(rows) for c in range(2)]
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (key, title, ylabel, log_y) in zip(axes[:4], _PANELS, strict=True):
        plotted = False
        for records, label, color in zip(runs, _labels(run_dirs), colors, strict=True):
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, color=color, linewidth=1.2, label=label)
                plotted = True
            if key == "loss":
                vx, vy = _series(records, "val_loss")
                if vx:
                    ax.plot(vx, vy, linestyle="none", marker="o", markersize=5, color=color, label=f"{label} (val)")
                    plotted = True
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if plotted:
            if log_y and all(y > 0 for r in runs for y in _series(r, key)[1]):
                ax.set_yscale("log")
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no '{key}' recorded", transform=ax.transAxes, ha="center", va="center")
    if moe:
        _expert_panels(axes[4], axes[5], runs, _labels(run_dirs), colors)
    for ax in axes[-2:]:
        ax.set_xlabel("step")
    if heat is not None:
        _load_heat_map(fig.add_subplot(grid[rows, :]), *heat)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def _expert_panels(load_ax, router_ax, runs, labels, colors) -> None:
    """Tokens per expert (mean line, min-max band; kept slots per expert and block in a step, whole batch)
    and the unweighted load-balancing loss (1 = uniform) with the fraction of slots dropped by the capacity."""
    for records, label, color in zip(runs, labels, colors, strict=True):
        xs, mean = _series(records, "moe_tokens_per_expert_mean")
        if not xs:
            continue
        _, lo = _series(records, "moe_tokens_per_expert_min")
        _, hi = _series(records, "moe_tokens_per_expert_max")
        load_ax.plot(xs, mean, color=color, linewidth=1.2, label=f"{label} (mean)")
        load_ax.fill_between(xs, lo, hi, color=color, alpha=0.2, label=f"{label} (min-max)")
        ax_, aux = _series(records, "moe_aux_loss")
        router_ax.plot(ax_, aux, color=color, linewidth=1.2, label=f"{label} aux loss")
        dx, dropped = _series(records, "moe_dropped_frac")
        if any(dropped):
            router_ax.plot(dx, dropped, color=color, linestyle=":", label=f"{label} dropped fraction")
    load_ax.set_title("expert load")
    load_ax.set_ylabel("tokens per expert")
    router_ax.set_title("router balance")
    router_ax.set_ylabel("E * sum f_i P_i  /  dropped")
    for ax in (load_ax, router_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")


def _load_layers(records) -> list[int]:
    """The MoE blocks whose per-expert load (``moe_load_layer{i}``) the run logged."""
    keys = {k for r in records for k in r if k.startswith("moe_load_layer")}
    return sorted(int(k.removeprefix("moe_load_layer")) for k in keys)


def _load_heat_map(ax, records, label: str) -> None:
    """Expert load over time: one row per (MoE block, expert), one column per logged step, the colour the
    expert's tokens relative to its block's mean that step (1 = balanced); blocks separated by lines."""
    import numpy as np

    layers = _load_layers(records)
    steps = [r["step"] for r in records if f"moe_load_layer{layers[0]}" in r]
    rows, names = [], []
    for layer in layers:
        loads = [r[f"moe_load_layer{layer}"] for r in records if f"moe_load_layer{layer}" in r]
        grid = np.asarray(loads, dtype=float).T  # [experts, steps]
        mean = grid.mean(axis=0, keepdims=True)
        rows.append(np.divide(grid, mean, out=np.zeros_like(grid), where=mean > 0))
        names += [f"{layer}.{e}" for e in range(grid.shape[0])]
    image = np.concatenate(rows)
    shown = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="magma", origin="upper",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(names) - 0.5, -0.5))
    edge = -0.5
    for block in rows[:-1]:
        edge += block.shape[0]
        ax.axhline(edge, color="white", linewidth=1.0)
    every = max(1, len(names) // 32)
    ax.set_yticks(range(0, len(names), every), names[::every], fontsize="small")
    ax.set_title(f"expert load per block ({label}): tokens / block mean, 1 = balanced")
    ax.set_xlabel("step")
    ax.set_ylabel("block.expert")
    ax.figure.colorbar(shown, ax=ax, label="load / mean")


def plot_timeline(run_dir: Path, out: Path | None = None) -> tuple[Path, Path]:
    """A pipeline run's schedule: a Gantt chart PNG (one row per stage rank) and a Chrome trace JSON,
    from the ``timeline.json`` the trainer keeps (the last logged step's events of every stage)."""
    import json

    from shardwise.parallel.pipeline import plot_gantt, write_chrome_trace
    from shardwise.parallel.pipeline.timeline import timelines_from_json

    run_dir = Path(run_dir)
    source = run_dir / "timeline.json"
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist: only pipeline runs (parallel.pp > 1) record a timeline")
    doc = json.loads(source.read_text())
    timelines = timelines_from_json(doc)
    png = Path(out) if out else run_dir / "timeline.png"
    v = f", v={doc['virtual']}" if doc["virtual"] > 1 else ""
    title = (f"{doc['schedule']} p={doc['pp']} m={doc['microbatches']}{v}, step {doc['step']}; "
             f"theory {doc['bubble_theory']:.1%}")
    plot_gantt(timelines, png, title=title)
    return png, write_chrome_trace(timelines, png.with_suffix(".trace.json"))
