"""The simulator beside the planner's formulas: ``plan --simulate-top K`` re-ranks the plan's best layouts by
their simulated step, ``plan --compare RUN_DIR`` sets the simulated step beside the formula and the run.

A planner layout becomes the trainer's config fields (``parallel.dp`` ... ``train.recompute``); the trainer's
checks then decide whether the engine can run it -- a layout the planner's arithmetic allows but the engine
refuses (e.g. sequence parallelism inside a tensor-parallel pipeline) is shown with the engine's reason.
"""

from __future__ import annotations

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.plan.spec import Layout
from shardwise.sim.hardware import SimHardware
from shardwise.sim.simulate import load_config, simulate


def layout_overrides(lay: Layout, schedule: str) -> dict[str, str]:
    """The config fields that run ``lay``."""
    out = {"parallel.dp": lay.dp, "parallel.tp": lay.tp, "parallel.pp": lay.pp, "parallel.cp": lay.cp,
           "parallel.ep": lay.ep, "parallel.zero": lay.zero,
           "parallel.sequence_parallel": str(lay.sequence_parallel).lower(), "train.micro_batch": lay.micro_batch,
           "train.grad_accum": lay.grad_accum, "train.recompute": lay.recompute, "train.global_batch": lay.global_batch}
    if lay.offload != "none":
        out["parallel.offload"] = lay.offload
    if lay.pp > 1:
        out["parallel.pp_virtual"] = lay.pp_virtual
        for slot in ("pp_embedding_slot", "pp_head_slot"):
            if getattr(lay, slot):
                out[f"parallel.{slot}"] = "true"
        out["parallel.pp_schedule"] = "interleaved" if lay.pp_virtual > 1 else schedule
        out["parallel.microbatches"] = lay.grad_accum
        del out["train.grad_accum"]
    return {k: str(v) for k, v in out.items()}


def simulate_layouts(config: str | None, overrides: dict[str, str], layouts: list[Layout], hw: SimHardware,
                     schedule: str = "1f1b") -> list[dict]:
    """For each layout: its simulated step, tokens/s, MFU, bubble and exposed communication, or why the engine
    would not run it."""
    out = []
    for lay in layouts:
        try:
            cfg = load_config(config, {**overrides, **layout_overrides(lay, schedule)}, hw)
            res = simulate(cfg, hw)
        except (ConfigError, ValueError) as e:
            out.append({"layout": lay.short(), "error": str(e)})
            continue
        s = res.summary()
        out.append({"layout": lay.short(), "step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"],
                    "mfu": s["mfu"], "bubble": s["bubble"], "exposed_comm_s": s["exposed_comm_s"],
                    "peak_memory_bytes": s["peak_memory_bytes"], "device_memory_bytes": s["device_memory_bytes"],
                    "fits": s["fits"], "exposed_causes": s["exposed_causes"]})
    return out


def simulate_best(config: str | None, overrides: dict[str, str], candidates: list, hw: SimHardware, k: int,
                  schedule: str = "1f1b", extra: int | None = None) -> tuple[list, list[dict]]:
    """Simulate the planner's ``candidates`` in its order until ``k`` of them fit in the device's memory (at
    most ``k + extra`` simulations, default ``2k`` more): ``(simulated candidates, their results)``. A layout
    whose simulated peak exceeds the device is never proposed (:func:`rerank_lines` lists it apart)."""
    extra = 2 * k if extra is None else extra
    done, results = [], []
    for cand in candidates[:k + extra]:
        results += simulate_layouts(config, overrides, [cand.layout], hw, schedule)
        done.append(cand)
        if sum(1 for r in results if r.get("fits")) >= k:
            break
    return done, results


def rerank_lines(planned: list, simulated: list[dict]) -> list[str]:
    """The plan's top layouts that fit re-ranked by simulated tokens/s, the formula's figures beside; those the
    engine would not run or whose simulated memory exceeds the device listed after, never ranked."""
    pairs = list(zip(planned, simulated, strict=True))
    rows = sorted([r for r in pairs if r[1].get("fits")], key=lambda r: -r[1]["tokens_per_s"])
    head = (f"{'#':>2}  {'layout':<40} {'formula step s':>14} {'simulated step s':>16} {'sim tokens/s':>13} "
            f"{'sim MFU':>7} {'sim bubble':>10}  exposed comm (s)")
    lines = ["re-ranked by the simulator (shardwise simulate):", head, "-" * len(head)]
    for i, (c, s) in enumerate(rows, 1):
        bubble = "" if s["bubble"] is None else f"{s['bubble']:.1%}"
        comm = ", ".join(f"{k} {v:.3g}" for k, v in sorted(s["exposed_comm_s"].items()))
        lines.append(f"{i:>2}  {s['layout']:<40} {c.time.step_time_s:>14.4g} {s['step_time_s']:>16.4g} "
                     f"{s['tokens_per_s']:>13,.0f} {s['mfu']:>7.1%} {bubble:>10}  {comm}")
        lines += [f"      {axis} mostly: {cause}" for axis, cause in _largest_causes(s.get("exposed_causes", []))]
    rejected = [r for r in pairs if not r[1].get("fits")]
    for c, s in rejected:
        why = (f"not run by the engine: {s['error']}" if "error" in s else
               f"does not fit: simulated {s['peak_memory_bytes'] / 1e9:.1f} GB per rank, the device has "
               f"{s['device_memory_bytes'] / 1e9:.0f} GB")
        lines.append(f" -  {s['layout']:<40} {c.time.step_time_s:>14.4g}  not proposed, {why}")
    return lines


def _largest_causes(causes: list[dict]) -> list[tuple[str, str]]:
    """Per axis, its largest exposed piece in a few words and the overlap that would hide it
    (:mod:`shardwise.sim.exposure`)."""
    out: dict[str, dict] = {}
    for c in causes:
        if c["axis"] not in out or c["exposed_s"] > out[c["axis"]]["exposed_s"]:
            out[c["axis"]] = c
    return [(axis, f"{c['exposed_s']:.3g} s {c['what']} -> {(c['hidden_by'] or '').split(':')[0]}")
            for axis, c in sorted(out.items(), key=lambda kv: -kv[1]["exposed_s"]) if c["exposed_s"] > 0]


def simulated_for_run(cfg: Config, hw: SimHardware) -> dict[str, float]:
    """The simulated step of a run's resolved config on ``hw`` (sized to the run's world)."""
    res = simulate(resolve(cfg), hw)
    return {"step_time_s": res.step_time_s, "tokens_per_s": res.tokens_per_s, "mfu": res.mfu,
            **({"bubble": res.bubble} if res.bubble is not None else {})}
