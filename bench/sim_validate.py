"""The simulator against this machine: calibrate it, run each layout with the trainer, simulate it, compare.

    python bench/sim_validate.py --json bench/results/sim_validate.json --plot bench/results/sim_validate.png
    sudo python bench/sim_validate.py ...      # also ZeRO-3 on 2 nodes x 2 ranks (network namespaces, 1 Gbit/s)

1. Calibrate (for k = 2 and 4 ranks, all computing at once, as in the layouts): per rank, the matmul FLOP/s and
   the copy bandwidth of k concurrent single-threaded processes; gloo's links on loopback from the cost model's
   own calibration (:func:`shardwise.dist.comm.cost.calibrate`: alpha and beta of a ring shift, the native
   all-reduce's per-call intercept); gloo's own all-reduce, all-gather, reduce-scatter and all-to-all for groups
   of 2 and k ranks at 4 KiB .. 16 MiB, one line per collective and group size (``bench/gloo_collectives.py``:
   what the simulator costs the collectives the engine hands to the backend by); then the two numbers the
   roofline leaves open -- the matmuls' efficiency and the cost of one operator (dispatch, autograd) -- fitted
   so the simulated step of one rank's share of the batch equals k concurrent single-rank trainer runs, once as
   one micro-batch and once as micro-batches of one sequence. Written as a --hardware file per k
   (``[gpu.this-cpu-k]``, ``[sim]`` and ``[sim.native_collectives]``; communication does not overlap
   computation on one host: k ranks keep the 2 cores busy). With root, the two namespace nodes' links
   (bench/bench_multinode.py's calibration; no native table: those groups cross the shaped link, whose
   transfers do run beside the computation: ``network_overlap``, see :mod:`shardwise.sim.hardware`).
2. Run each layout of issue 27 with ``shardwise train`` (a 8-layer, d=256 GPT, fp32, 16 sequences of 128 tokens
   a step): the fastest step past warm-up (the median beside it), for pipelines the bubble of the trainer's
   timeline, and for experts the routing's imbalance over the expert ranks in the same steps
   (:func:`shardwise.sim.costs.routing_imbalance`: the simulator takes it as an input, as ``shardwise simulate
   --moe-imbalance`` does; routing is the model's, not the cluster's).
3. Simulate each with the calibrated hardware; the table, and a plot: step times side by side, and for each
   pipeline the simulated timeline of every rank under the measured one.

Timings on a machine shared with other work are noise: run it alone; the figures it prints then are the ones
to quote.

    python bench/sim_validate.py --simulate-only bench/results/sim_validate.json --hardware-dir DIR

simulates again, without training or calibrating, every layout of a results file against its measured steps,
with the hardware files in DIR (e.g. copies of the committed ones given a new ``[sim.native_collectives]`` by
``bench/gloo_collectives.py --into``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

import gloo_collectives  # noqa: E402  (bench/, on the path above)

MODEL = ["--model.n_layers", "8", "--model.d_model", "256", "--model.n_heads", "8", "--data.seq_len", "128",
         "--train.precision", "fp32", "--train.global_batch", "16", "--train.eval_every", "0", "--ckpt.every", "0",
         "--run.progress", "false", "--run.tensorboard", "false", "--data.max_bytes", "1000000"]
LAYOUTS = [  # name, ranks, overrides
    ("dp 2", 2, {}),
    ("ZeRO-3 dp 2", 2, {"parallel.zero": "3"}),
    ("ZeRO-3 dp 4", 4, {"parallel.zero": "3"}),
    ("pp 2 1F1B", 2, {"parallel.pp": "2", "parallel.microbatches": "8"}),
    ("pp 2 interleaved", 2, {"parallel.pp": "2", "parallel.microbatches": "8", "parallel.pp_schedule": "interleaved",
                             "parallel.pp_virtual": "2"}),
    ("pp 4 1F1B", 4, {"parallel.pp": "4", "parallel.microbatches": "8"}),
    ("pp 4 interleaved", 4, {"parallel.pp": "4", "parallel.microbatches": "8", "parallel.pp_schedule": "interleaved",
                             "parallel.pp_virtual": "2"}),
    ("tp 2", 2, {"parallel.tp": "2"}),
    ("tp 2 + SP", 2, {"parallel.tp": "2", "parallel.sequence_parallel": "true"}),
    ("cp 2", 2, {"parallel.cp": "2"}),
    ("ep 2", 2, {"model.n_experts": "4", "parallel.ep": "2"}),
]
NETNS = ("ZeRO-3 2 nodes x 2", 4, {"parallel.zero": "3"})


def flags(overrides: dict[str, str]) -> list[str]:
    return [x for k, v in overrides.items() for x in (f"--{k}", v)]


# ---- 1. calibration -----------------------------------------------------------------------------------------


def _probe(rank: int, world: int, port: int, out: str) -> None:
    """One of ``world`` concurrent ranks: compute, memory and operator costs, then gloo's links."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))

    def timed(fn, seconds=1.0):
        """The fastest of the calls made in ``seconds`` (other work on the machine only adds time)."""
        dist.barrier()
        fn()
        best, t0 = float("inf"), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    flops = 0.0
    for n in (256, 512, 1024):  # the best a matmul reaches: the roofline's peak
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = max(flops, 2 * n**3 / timed(lambda a=a, b=b: torch.mm(a, b)))
    x, y = torch.randn(4 << 20), torch.empty(4 << 20)
    bandwidth = 2 * x.numel() * 4 / timed(lambda: y.copy_(x))
    from shardwise.dist.comm.cost import calibrate

    model = calibrate(None, large=4 << 20)
    native = model.native["all_reduce"][0]
    result = torch.tensor([flops, bandwidth, model.alpha, model.beta, native], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.SUM)
    collectives = gloo_collectives.measure(world)  # gloo's own collectives, groups of 2 and of world ranks
    if rank == 0:
        Path(out).write_text(json.dumps({"probe": (result / world).tolist(), "native": collectives}))
    dist.barrier()
    dist.destroy_process_group()


def probe(world: int) -> dict:
    import torch.multiprocessing as mp

    from shardwise.dist.mesh import free_port

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mp.spawn(_probe, args=(world, free_port(), out), nprocs=world)
    doc = json.loads(Path(out).read_text())
    os.unlink(out)
    flops, bandwidth, alpha, beta, native = doc["probe"]
    medians = {c: {int(n): t for n, t in by_n.items()} for c, by_n in doc["native"].items()}
    return {"flops": flops, "bandwidth": bandwidth, "alpha_s": alpha, "beta_s_per_byte": beta,
            "native_all_reduce_intercept_s": native, "native_sizes": list(gloo_collectives.SIZES),
            "native_median_s": medians, "native_collectives": gloo_collectives.fits(medians)}


def hardware_file(path: Path, name: str, p: dict, efficiency: float = 1.0, overhead_s: float = 0.0,
                  links: dict | None = None) -> Path:
    """A --hardware file for this machine with ``p`` (a :func:`probe`) and, for namespaces, two-level links."""
    tflops = p["flops"] / 1e12
    intra_bw = 1 / (links["beta_intra_s_per_byte"] if links else p["beta_s_per_byte"])
    alpha = links["alpha_intra_s"] if links else p["alpha_s"]
    call = max(0.0, p["native_all_reduce_intercept_s"] - 2 * p["alpha_s"])  # beyond a 2-rank ring's latency
    lines = [f"[gpu.{name}]", f"fp32_tflops = {tflops}", f"bf16_tflops = {tflops}", "memory_gb = 16",
             f"nvlink_gbps = {2 * intra_bw / 1e9}", f"intra_latency_us = {alpha * 1e6}"]
    sim = ["[sim]", f"hbm_gbps = {p['bandwidth'] / 1e9}", f"matmul_efficiency = {efficiency}",
           f"attention_efficiency = {efficiency}", "memory_efficiency = 1.0",
           f"kernel_overhead_us = {overhead_s * 1e6}", f"call_latency_us = {call * 1e6}", 'attention = "flash"',
           'backend = "gloo"', "overlap = false"]
    if links:  # one NIC per node (the veth pair), shared by the node's two ranks
        lines += [f"network_gbit = {8 / links['beta_flow_s_per_byte'] / 1e9}",
                  f"inter_latency_us = {links['alpha_inter_s'] * 1e6}"]
        sim += ["nics_per_node = 1", f"nic_gbit = {8 / links['beta_node_s_per_byte'] / 1e9}"]
    else:
        lines += ["network_gbit = 1"]
    text = "\n".join(lines + [""] + sim) + "\n"
    if p.get("native_collectives") and not links:  # measured on loopback: not the namespaces' links
        text += "\n" + gloo_collectives.toml_table(p["native_collectives"])
    path.write_text(text)
    return path


# ---- 2. the trainer -------------------------------------------------------------------------------------------


def train(tmp: Path, name: str, ranks: int, overrides: dict[str, str], steps: int, env: dict | None = None,
          solo: bool = False) -> Path:
    run_dir = tmp / name.replace(" ", "_").replace("+", "p")
    args = [sys.executable, "-m", "shardwise.cli", "train", *MODEL, *flags(overrides), "--train.steps", str(steps),
            "--parallel.nproc", str(ranks), "--run.dir", str(run_dir), "--data.cache_dir", str(tmp / "cache")]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    subprocess.run(args, check=True, capture_output=True, text=True, env=env, timeout=1800)
    return run_dir


def measured(run_dir: Path, ep: int = 1) -> dict:
    """The fastest step past warm-up (other work on the machine only adds time; the median beside it), the
    routing's imbalance over the ``ep`` expert ranks in the same steps (the simulator's input for it) and, for a
    pipeline, the trainer's timeline of its last recorded step."""
    from shardwise.sim.costs import routing_imbalance

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step_time_s"] for r in records if r.get("step", 0) >= 3 and "step_time_s" in r]
    out = {"step_time_s": min(steps), "median_step_time_s": statistics.median(steps),
           "moe_imbalance": routing_imbalance(records, ep, first_step=3)}
    timeline = run_dir / "timeline.json"
    if timeline.exists():
        doc = json.loads(timeline.read_text())
        out["bubble"], out["timeline"] = doc["bubble"], doc
    return out


def solo_step(tmp: Path, k: int, steps: int, micro_batch: int) -> float:
    """The step of k concurrent single-rank runs, each on one rank's share of the batch in micro-batches of
    ``micro_batch`` (one thread each, as the launcher gives each of k ranks on this machine)."""
    share = ["--train.global_batch", str(16 // k), "--train.micro_batch", str(micro_batch)]
    procs = []
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for i in range(k):
        run_dir = tmp / f"solo{k}_{micro_batch}_{i}"
        args = [sys.executable, "-m", "shardwise.cli", "train", *MODEL, *share, "--train.steps", str(steps),
                "--parallel.nproc", "1", "--run.dir", str(run_dir), "--data.cache_dir", str(tmp / "cache")]
        procs.append((subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                      run_dir))
    for p, _ in procs:
        if p.wait(timeout=1800):
            raise RuntimeError(p.stderr.read()[-2000:])
    return min(measured(d)["step_time_s"] for _, d in procs)


# ---- 3. the simulator -------------------------------------------------------------------------------------------


def simulate_layout(overrides: dict[str, str], hw_file: Path, name: str, nodes: int, ranks_per_node: int,
                    moe_imbalance: float = 1.0, **sim):
    from shardwise.cli import split_overrides
    from shardwise.sim.hardware import build_hardware
    from shardwise.sim.simulate import load_config, simulate

    _, over = split_overrides(MODEL + flags(overrides))
    hw = build_hardware(name, nodes, ranks_per_node, hw_file, **sim)
    return simulate(load_config(None, over, hw), hw, moe_imbalance)


def fit_compute(hw_file: Path, name: str, k: int, big: float, small: float) -> tuple[float, float]:
    """``(efficiency, seconds per operator)`` at which one rank's share of the batch simulates in ``big`` seconds
    as one micro-batch and in ``small`` seconds as micro-batches of one sequence (nested bisections: the second
    run is the one the per-operator cost decides)."""
    share = {"train.global_batch": str(16 // k)}

    def step(eff: float, overhead: float, micro: int) -> float:
        return simulate_layout({**share, "train.micro_batch": str(micro)}, hw_file, name, 1, 1,
                               matmul_efficiency=eff, attention_efficiency=eff,
                               kernel_overhead_us=overhead * 1e6).step_time_s

    def efficiency(overhead: float) -> float:
        lo, hi = 1e-3, 1.0
        for _ in range(14):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if step(mid, overhead, 16 // k) < big else (mid, hi)
        return (lo + hi) / 2

    lo, hi = 0.0, 1e-3
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if step(efficiency(mid), mid, 1) > small else (mid, hi)
    overhead = (lo + hi) / 2
    return efficiency(overhead), overhead


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--hardware-dir", type=Path, default=ROOT / "bench" / "results",
                    help="where the calibrated hardware files go (sim_this_machine_k<k>.toml)")
    ap.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    ap.add_argument("--simulate-only", type=Path, metavar="RESULTS.json",
                    help="no training or calibration: simulate the layouts of RESULTS.json with --hardware-dir's files")
    args = ap.parse_args()
    if args.simulate_only:
        return resimulate(args.simulate_only, args.hardware_dir, args.json)
    result: dict = {"calibration": {}, "layouts": []}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        files = {}
        for k in (2, 4):
            p = probe(k)
            big, small = solo_step(tmp, k, args.steps, 16 // k), solo_step(tmp, k, args.steps, 1)
            name = f"this-cpu-{k}"
            path = hardware_file(args.hardware_dir / f"sim_this_machine_k{k}.toml", name, p)
            eff, overhead = fit_compute(path, name, k, big, small)
            hardware_file(path, name, p, eff, overhead)
            files[k] = (path, name)
            result["calibration"][k] = {**p, "solo_step_s": big, "solo_step_micro1_s": small, "efficiency": eff,
                                        "operator_s": overhead, "file": str(path)}
            print(f"k={k}: {p['flops'] / 1e9:.1f} GFLOP/s, {p['bandwidth'] / 1e9:.1f} GB/s, alpha "
                  f"{p['alpha_s'] * 1e6:.0f} us, {1 / p['beta_s_per_byte'] / 1e9:.2f} GB/s; solo steps {big * 1e3:.1f} "
                  f"/ {small * 1e3:.1f} ms -> efficiency {eff:.3f}, {overhead * 1e6:.1f} us per operator", flush=True)
        for name, ranks, over in LAYOUTS:
            if args.only and name not in args.only:
                continue
            m = measured(train(tmp, name, ranks, over, args.steps), int(over.get("parallel.ep", 1)))
            res = simulate_layout(over, *files[ranks], 1, ranks, m["moe_imbalance"])
            row = {"layout": name, "ranks": ranks, "measured_step_s": m["step_time_s"],
                   "measured_median_step_s": m["median_step_time_s"], "moe_imbalance": m["moe_imbalance"],
                   "simulated_step_s": res.step_time_s, "error": res.step_time_s / m["step_time_s"] - 1,
                   "measured_bubble": m.get("bubble"), "simulated_bubble": res.bubble,
                   "simulated_exposed_comm_s": res.exposed_s, "measured_timeline": m.get("timeline"),
                   "simulated_timeline": _timeline(res) if res.bubble is not None else None}
            result["layouts"].append(row)
            bubble = "" if row["measured_bubble"] is None else \
                f"; bubble {row['measured_bubble']:.1%} measured, {row['simulated_bubble']:.1%} simulated"
            print(f"{name:<20} measured {m['step_time_s'] * 1e3:8.1f} ms, simulated {res.step_time_s * 1e3:8.1f} ms "
                  f"({row['error']:+.0%}){bubble}", flush=True)
        if os.geteuid() == 0 and (not args.only or NETNS[0] in args.only):
            result["layouts"].append(_netns(tmp, args.steps, result["calibration"][4], args.hardware_dir))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if args.plot:
        plot(result, args.plot)
    return 0


def resimulate(results: Path, hardware_dir: Path, out: Path | None) -> int:
    """Every layout of ``results`` simulated again with the hardware files of ``hardware_dir``, against the
    measured steps there."""
    rows = []
    for row in json.loads(results.read_text())["layouts"]:
        netns = row["layout"] == NETNS[0]
        over = NETNS[2] if netns else next(o for name, _, o in LAYOUTS if name == row["layout"])
        name = "this-cpu-netns" if netns else f"this-cpu-{row['ranks']}"
        path = hardware_dir / ("sim_this_machine_netns.toml" if netns else f"sim_this_machine_k{row['ranks']}.toml")
        res = simulate_layout(over, path, name, 2 if netns else 1, 2 if netns else row["ranks"],
                              row.get("moe_imbalance", 1.0))
        error = res.step_time_s / row["measured_step_s"] - 1
        bubble = "" if row.get("measured_bubble") is None else \
            f"; bubble {row['measured_bubble']:.1%} measured, {res.bubble:.1%} simulated"
        comm = ", ".join(f"{axis} {s * 1e3:.0f}" for axis, s in res.exposed_s.items())
        print(f"{row['layout']:<20} measured {row['measured_step_s'] * 1e3:8.1f} ms, simulated "
              f"{res.step_time_s * 1e3:8.1f} ms ({error:+.0%}); exposed comm ms: {comm}{bubble}", flush=True)
        if row.get("measured_timeline"):
            for line in timeline_breakdown(row["measured_timeline"]):
                print("    " + line)
        rows.append({"layout": row["layout"], "ranks": row["ranks"], "measured_step_s": row["measured_step_s"],
                     "moe_imbalance": row.get("moe_imbalance", 1.0), "simulated_step_s": res.step_time_s,
                     "error": error, "simulated_exposed_comm_s": res.exposed_s,
                     "measured_bubble": row.get("measured_bubble"), "simulated_bubble": res.bubble,
                     "algorithms": res.algorithms})
    if out:
        out.write_text(json.dumps({"measured_in": str(results), "hardware_dir": str(hardware_dir), "layouts": rows},
                                  indent=1, default=str))
    return 0


def timeline_breakdown(doc: dict) -> list[str]:
    """Where each pipeline rank's measured span went (the trainer's timeline: the same events its bubble is
    computed from): computing (F/B/W, with the spread of their durations), waiting for a receive, posting
    transfers, and the rest."""
    out = []
    for t in doc["timelines"]:
        events = t["events"]
        busy = [e["end"] - e["start"] for e in events if e["kind"] in ("F", "B", "W")]
        forward = sorted(e["end"] - e["start"] for e in events if e["kind"] == "F")
        wait = sum(e["end"] - e["start"] for e in events if e["kind"] == "wait")
        posts = {(e["start"], e["end"]) for e in events if e["kind"] in ("send", "recv")}  # one batch: one interval
        post = sum(b - a for a, b in posts)
        span = t["end"] - t["start"]
        longest = max(b - a for a, b in posts)
        out.append(f"rank {t['rank']}: span {span * 1e3:.0f} ms = compute {sum(busy) * 1e3:.0f} + wait "
                   f"{wait * 1e3:.0f} + posting {post * 1e3:.0f} ({len(posts)} batches, longest {longest * 1e3:.1f}) "
                   f"+ other {(span - sum(busy) - wait - post) * 1e3:.0f}; F {forward[0] * 1e3:.0f} .. "
                   f"{forward[-1] * 1e3:.0f} ms")
    return out


def _timeline(res) -> list[list[tuple]]:
    from shardwise.parallel.pipeline.schedules import B, F, W

    return [[(t.kind, t.args.get("mb"), t.start, t.end) for t in res.graph.rank_tasks(r) if t.kind in (F, B, W)]
            for r in range(res.graph.n_ranks)]


def _netns(tmp: Path, steps: int, cal: dict, out_dir: Path) -> dict:
    """ZeRO-3 on the two namespace nodes (2 ranks each) over the 1 Gbit/s shaped link."""
    import bench_multinode as mn

    name, ranks, over = NETNS
    try:
        mn.sh("up", "1gbit")
        links = mn.all_reduce_table("1M,4M", 3)["model"]
        path = hardware_file(out_dir / "sim_this_machine_netns.toml", "this-cpu-netns", cal, cal["efficiency"],
                             cal["operator_s"], links)
        run_dir = tmp / "netns"
        args = [sys.executable, "-m", "shardwise.cli", "train", *MODEL, *flags(over), "--train.steps", str(steps),
                "--parallel.nproc", "2", "--parallel.nnodes", "2", "--parallel.rdzv_endpoint", f"{mn.ADDR[0]}:29400",
                "--run.dir", str(run_dir), "--data.cache_dir", str(tmp / "cache")]
        mn.finish([mn.in_ns(n, args) for n in range(2)])
    finally:
        mn.sh("down")
    m = measured(run_dir)
    res = simulate_layout(over, path, "this-cpu-netns", 2, 2)
    print(f"{name:<20} measured {m['step_time_s'] * 1e3:8.1f} ms, simulated {res.step_time_s * 1e3:8.1f} ms "
          f"({res.step_time_s / m['step_time_s'] - 1:+.0%})", flush=True)
    return {"layout": name, "ranks": ranks, "measured_step_s": m["step_time_s"], "simulated_step_s": res.step_time_s,
            "error": res.step_time_s / m["step_time_s"] - 1, "measured_bubble": None, "simulated_bubble": None,
            "simulated_exposed_comm_s": res.exposed_s, "links": links}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["layouts"]
    pipes = [r for r in rows if r.get("measured_timeline")]
    fig = plt.figure(figsize=(12, 3.5 + 2.2 * len(pipes)))
    grid = fig.add_gridspec(1 + len(pipes), 1, height_ratios=[3] + [2] * len(pipes))
    ax = fig.add_subplot(grid[0])
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_step_s"] * 1e3 for r in rows], 0.4, label="measured (trainer)")
    ax.bar([x + 0.2 for x in xs], [r["simulated_step_s"] * 1e3 for r in rows], 0.4, label="simulated")
    ax.set_xticks(list(xs), [r["layout"] for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("step (ms)")
    ax.legend(fontsize=8)
    colours = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
    for i, r in enumerate(pipes, 1):
        a = fig.add_subplot(grid[i])
        tl = r["measured_timeline"]
        t0 = min(t["start"] for t in tl["timelines"])
        p = len(tl["timelines"])
        for t in tl["timelines"]:
            for e in t["events"]:
                if e["kind"] in colours:
                    a.barh(t["rank"], (e["end"] - e["start"]) * 1e3, left=(e["start"] - t0) * 1e3, height=0.4,
                           color=colours[e["kind"]])
        for rank, events in enumerate(r["simulated_timeline"]):
            first = min(ev[2] for evs in r["simulated_timeline"] for ev in evs)
            for kind, _, start, end in events:
                a.barh(p + rank + 0.5, (end - start) * 1e3, left=(start - first) * 1e3, height=0.4, color=colours[kind],
                       alpha=0.6)
        a.set_yticks([*range(p), *(p + x + 0.5 for x in range(p))],
                     [f"measured {x}" for x in range(p)] + [f"simulated {x}" for x in range(p)], fontsize=7)
        a.invert_yaxis()
        a.set_title(f"{r['layout']}: bubble {r['measured_bubble']:.1%} measured, {r['simulated_bubble']:.1%} "
                    "simulated", fontsize=9)
        a.set_xlabel("ms", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
