"""This machine as the simulator's hardware, from microbenchmarks only: nothing here runs the trainer or looks at a
layout's step time.

    python bench/sim_calibrate.py --ranks 2 4 --out-dir bench/results     # sim_this_machine_k{2,4}.toml

For k ranks computing at once (k concurrent single-threaded processes, as the trainer's ranks on this machine), each
rank measures:

* the peak: the best FLOP/s of n x n matrix products (n = 256, 512, 1024);
* the **share of a core** each rank keeps while all k multiply at once: the best call's time over the mean call's
  time of a 512 x 512 product run back to back for a second by every rank together (k ranks on fewer cores share
  them; a best-of timing alone finds the moments a rank had a core to itself). The hardware file's FLOP/s are the
  peak times this share and its per-operator cost the measured one over it;
* the **matrix products' efficiency**: the model's own products -- every ``(m x k) @ (k x n)`` the simulator traces
  for one rank's share of the validation model (:mod:`shardwise.sim.compute`'s recorder gives the shapes), each
  timed alone, best of its calls -- their FLOPs over their summed time, over the peak;
* the **cost of one operator**: a chain of N small element-wise operators run forward and backward under autograd,
  N = 100 .. 800, the operators counted by the same recorder; the slope of time against operators by least
  squares (what dispatch, autograd and Python cost per operator once the data is small);
* copy bandwidth (a 16 MiB copy), gloo's links (:func:`shardwise.dist.comm.cost.calibrate`: a ring shift's alpha
  and beta) and gloo's own collectives (``bench/gloo_collectives.py``: a line per collective and group size, each
  call after :data:`gloo_collectives.COMPUTE_S` of matrix products).

A calibration quantity that comes out at the edge of what it may be -- an efficiency at or above 1 (clamped), a
per-operator slope at or below 0 (clamped) -- is a **collapsed fit** and is reported as a failure
(:func:`collapsed`), never written as if it were a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

import gloo_collectives  # noqa: E402  (bench/, on the path above)

OPERATOR_CHAIN = (100, 200, 400, 800)
"""Chain lengths of the per-operator microbenchmark."""


# ---- what the simulator will charge: the model's matrix products --------------------------------------------


def matmul_shapes(overrides: dict[str, str], k: int) -> dict[tuple[int, int, int, int], int]:
    """``{(batch, m, n, k): count}`` of every matrix product the simulator traces for one of ``k`` data-parallel
    ranks of the config ``overrides`` (forward and backward of every piece, one micro-batch)."""
    from shardwise.sim.costs import RankCosts
    from shardwise.sim.hardware import build_hardware
    from shardwise.sim.simulate import load_config

    hw = build_hardware("A100", 1, k, backend="gloo", overlap=False, sms=0)
    cfg = load_config(None, overrides, hw)
    costs = RankCosts(cfg, hw)
    pieces = {"embed": 1, "head": 1, "block": cfg.model.n_layers}
    out: dict[tuple[int, int, int, int], int] = {}
    for name, count in pieces.items():
        trace = costs.traces[name]
        for op in (*trace.fwd, *trace.bwd):
            if op.shape is not None:
                out[op.shape] = out.get(op.shape, 0) + count
    return out


# ---- the microbenchmarks, on every one of k concurrent ranks -------------------------------------------------


def _timed(fn, seconds: float = 0.5) -> float:
    """The fastest call within ``seconds`` (after one warm-up): other work on the machine only adds time."""
    fn()
    best, t0 = float("inf"), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_efficiency(shapes: dict, peak: float) -> float:
    """FLOPs of the shapes (with their counts) over their timed seconds, over ``peak``; unclamped."""
    import torch

    flops = seconds = 0.0
    for (batch, m, n, k), count in shapes.items():
        a, b = torch.randn(batch, m, k), torch.randn(batch, k, n)
        call = (lambda a=a, b=b: torch.bmm(a, b)) if batch > 1 else (lambda a=a[0], b=b[0]: torch.mm(a, b))
        t = _timed(call, 0.2)
        flops += count * 2.0 * batch * m * n * k
        seconds += count * t
    return flops / seconds / peak


def core_share(seconds: float = 1.0) -> float:
    """The best call's time over the mean call's time of a 512 x 512 product repeated for ``seconds`` (call it
    right after a barrier on every rank, so that all run at once); at most 1."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    best = _timed(lambda: torch.mm(a, b), 0.3)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        calls += 1
    return min(1.0, best / ((time.perf_counter() - t0) / calls))


def operator_seconds() -> tuple[float, list[tuple[int, float]]]:
    """The slope of a forward-and-backward chain's time against its operators (least squares), and the points."""
    import torch

    from shardwise.sim.compute import _Recorder

    def chain(n: int):
        x = torch.randn(64, requires_grad=True)

        def run():
            y = x
            for _ in range(n):
                y = y * 1.0001
            y.sum().backward()
        return run

    points = []
    for n in OPERATOR_CHAIN:
        run = chain(n)
        recorder = _Recorder(set())
        with recorder:
            run()
        points.append((len(recorder.ops), _timed(run, 0.4)))
    from shardwise.dist.comm.fit import fit_line

    _, slope = fit_line([float(ops) for ops, _ in points], [t for _, t in points])
    return slope, points


def _probe(rank: int, world: int, port: int, out: str, shapes: dict) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    dist.barrier()
    peak = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        peak = max(peak, 2 * n**3 / _timed(lambda a=a, b=b: torch.mm(a, b)))
    dist.barrier()
    share = core_share()
    dist.barrier()
    efficiency = matmul_efficiency({tuple(map(int, s.split(","))): c for s, c in shapes.items()}, peak)
    dist.barrier()
    per_op, points = operator_seconds()
    x, y = torch.randn(4 << 20), torch.empty(4 << 20)
    bandwidth = 2 * x.numel() * 4 / _timed(lambda: y.copy_(x))
    from shardwise.dist.comm.cost import calibrate

    model = calibrate(None, large=4 << 20)
    native = model.native["all_reduce"][0]
    result = torch.tensor([peak, efficiency, per_op, bandwidth, model.alpha, model.beta, native, share],
                          dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.SUM)
    collectives = gloo_collectives.measure(world)
    if rank == 0:
        Path(out).write_text(json.dumps({"probe": (result / world).tolist(), "native": collectives,
                                         "operator_points": points}))
    dist.barrier()
    dist.destroy_process_group()


def probe(world: int, shapes: dict) -> dict:
    """Every microbenchmark on ``world`` concurrent ranks (means over the ranks)."""
    import torch.multiprocessing as mp

    from shardwise.dist.mesh import free_port

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    keyed = {",".join(map(str, s)): c for s, c in shapes.items()}
    mp.spawn(_probe, args=(world, free_port(), out, keyed), nprocs=world)
    doc = json.loads(Path(out).read_text())
    os.unlink(out)
    peak, eff, per_op, bandwidth, alpha, beta, native, share = doc["probe"]
    medians = {c: {int(n): t for n, t in by_n.items()} for c, by_n in doc["native"].items()}
    return {"flops": peak, "core_share": share, "matmul_efficiency_measured": eff, "operator_s_measured": per_op,
            "operator_points": doc["operator_points"], "matmul_shapes": len(shapes), "bandwidth": bandwidth,
            "alpha_s": alpha, "beta_s_per_byte": beta, "native_all_reduce_intercept_s": native,
            "native_sizes": list(gloo_collectives.SIZES), "native_median_s": medians,
            "native_collectives": gloo_collectives.fits(medians)}


# ---- collapsed fits ------------------------------------------------------------------------------------------

BOUNDS = {"matmul_efficiency": (0.0, 1.0), "operator_s": (0.0, 1e-3)}
"""What each calibrated quantity may be; one measured at or beyond a bound is clamped there and reported."""


def collapsed(values: dict[str, float], bounds: dict[str, tuple[float, float]] | None = None,
              margin: float = 1e-3) -> list[str]:
    """The calibrated quantities at (within ``margin`` of the range) or beyond their bounds, each as one line: a
    calibration that collapsed onto its bound measured nothing, so the simulation built on it is a failure, not a
    fit."""
    out = []
    for name, (lo, hi) in (bounds or BOUNDS).items():
        v = values[name]
        edge = margin * (hi - lo)
        if v <= lo + edge or v >= hi - edge:
            out.append(f"{name} = {v:.6g} is at the bound of [{lo:g}, {hi:g}]: the calibration collapsed")
    return out


def clamped(name: str, value: float) -> float:
    lo, hi = BOUNDS[name]
    return min(max(value, lo), hi)


def hardware_file(path: Path, name: str, p: dict, links: dict | None = None) -> Path:
    """A --hardware file for this machine from a :func:`probe` ``p`` and, for network namespaces, two-level
    links (``bench/bench_multinode.py``'s calibration)."""
    share = p.get("core_share", 1.0)  # the rate a rank keeps while every rank computes
    tflops = p["flops"] * share / 1e12
    intra_bw = 1 / (links["beta_intra_s_per_byte"] if links else p["beta_s_per_byte"])
    alpha = links["alpha_intra_s"] if links else p["alpha_s"]
    call = max(0.0, p["native_all_reduce_intercept_s"] - 2 * p["alpha_s"])  # beyond a 2-rank ring's latency
    eff = clamped("matmul_efficiency", p["matmul_efficiency_measured"])
    per_op = clamped("operator_s", p["operator_s_measured"]) / share
    lines = ["# Microbenchmarks only (bench/sim_calibrate.py); no layout's step time went into this file.",
             f"[gpu.{name}]", f"fp32_tflops = {tflops}", f"bf16_tflops = {tflops}", "memory_gb = 16",
             f"nvlink_gbps = {2 * intra_bw / 1e9}", f"intra_latency_us = {alpha * 1e6}"]
    sim = ["[sim]", f"hbm_gbps = {p['bandwidth'] / 1e9}", f"matmul_efficiency = {eff}",
           f"attention_efficiency = {eff}", "memory_efficiency = 1.0",
           f"kernel_overhead_us = {per_op * 1e6}", f"call_latency_us = {call * 1e6}", 'attention = "flash"',
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


def calibrate(ranks: int, model_overrides: dict[str, str], out_dir: Path) -> tuple[Path, dict, list[str]]:
    """Probe ``ranks`` concurrent ranks and write ``sim_this_machine_k{ranks}.toml``: ``(file, probe,
    collapsed-fit failures)``."""
    shapes = matmul_shapes({**model_overrides, "train.global_batch": str(16 // ranks)}, 1)
    p = probe(ranks, shapes)
    failures = collapsed({"matmul_efficiency": p["matmul_efficiency_measured"],
                          "operator_s": p["operator_s_measured"]})
    path = hardware_file(out_dir / f"sim_this_machine_k{ranks}.toml", f"this-cpu-{ranks}", p)
    return path, p, failures


def main() -> int:
    from sim_validate import MODEL_OVERRIDES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    failed = False
    for k in args.ranks:
        path, p, failures = calibrate(k, MODEL_OVERRIDES, args.out_dir)
        print(f"k={k}: {p['flops'] / 1e9:.1f} GFLOP/s peak, {p['core_share']:.2f} of it kept while all compute, "
              f"the model's products at "
              f"{p['matmul_efficiency_measured']:.3f} of it ({p['matmul_shapes']} shapes), "
              f"{p['operator_s_measured'] * 1e6:.1f} us per operator, "
              f"{p['bandwidth'] / 1e9:.1f} GB/s -> {path}")
        for line in failures:
            print(f"  CALIBRATION FAILED: {line}")
        failed |= bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
