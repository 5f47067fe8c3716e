"""``shardwise bench comm``: time every algorithm of a collective against the native one.

For each algorithm and message size it reports the time, the algorithm bandwidth
``algbw = S / t`` and the bus bandwidth as defined by nccl-tests
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): all-reduce
``busbw = algbw * 2(N-1)/N``; reduce-scatter, all-gather, all-to-all, gather, scatter
``* (N-1)/N``; broadcast, reduce ``* 1``; the cost model's prediction and its error; and the
ratio of busbw to native's, measured interleaved with it (A B, B A, ...; "native beside" is
that native time, the "native" row the median of them), by best times and as the median of the
per-repetition ratios ("paired median", the steadier of the two on a shared machine). "auto" is
timed as it really runs, beside native like the others: for all-reduce the trainer's own
:class:`.compress.GradientAllReduce` with ``algorithm="auto"`` (its calibration in the warm-up
call, then the cost model's pick per size and the dispatch on every call); for the other
collectives the calibrated model's ``choose`` and the chosen algorithm, on every call. Times are
the best of ``--reps`` (the slowest rank's).

    shardwise bench comm --collective all_reduce --sizes 4K,1M,16M,64M --nproc 4 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.bench_result import BenchRun, add_machine_note
from shardwise.dist.mesh import free_port, shutdown_distributed

from .workload import run_collective

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "barrier": lambda n: 0.0}


def parse_size(text: str) -> int:
    """"4K" -> 4096, "64M" -> 64 MiB, "1G", or plain bytes."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def parse_sizes(text: str) -> list[int]:
    """"4K,1M" is a list; "4K..64M" every power-of-4 multiple from 4K to 64M."""
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split(".."))
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 4
        return out
    return [parse_size(t) for t in text.split(",") if t]


def _auto_closure(collective: str, nbytes: int, model, n: int, local_world_size: int | None = None):
    """``(closure, pick)``: "auto" as the code that uses it runs it, and a function naming the
    algorithm it ended up running (``local_world_size``: the ranks per node, as the trainer passes it)."""
    if collective == "all_reduce":
        from .compress import GradientAllReduce

        fn = GradientAllReduce("auto", local_world_size=local_world_size)
        x = torch.randn(max(nbytes // 4 // n, 1) * n)  # as run_collective sizes it

        def run():
            work = fn(x, None)
            if work is not None:
                work.wait()

        return run, lambda: next(iter(fn.choices.values()))
    chosen = {}

    def run_chosen():
        real = model.choose(collective, nbytes)
        if real not in chosen:
            chosen[real] = run_collective(collective, real, nbytes, None, n)
        chosen[real]()

    return run_chosen, lambda: next(iter(chosen))


def _measure(fns: list, reps: int, group) -> tuple[list[float], float]:
    """Best-of-``reps`` seconds of each closure (the slowest rank's), after one warm-up each, and the median over
    the repetitions of ``time(first) / time(last)`` -- of native against the other, its ratio to native.

    The closures run interleaved, the order reversed every repetition (A B, B A, ...), so that drift on a shared
    machine, and whatever the call just before leaves behind, hit ours and the baseline alike; the minimum,
    because on a shared machine noise only ever adds time; the paired median, because a best-of-N of two
    equal calls still differs by the luck of one sample (two runs of "auto -> native" against native gave
    0.73-1.37 by minima on the loaded machine).
    """
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        order = list(range(len(fns))) if rep % 2 == 0 else list(reversed(range(len(fns))))
        for i in order:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fns[i]()
            samples[i].append(time.perf_counter() - t0)
    per_rep = torch.tensor(samples, dtype=torch.float64)  # [fns, reps]
    dist.all_reduce(per_rep, op=dist.ReduceOp.MAX, group=group)  # each repetition's slowest rank
    paired = float((per_rep[0] / per_rep[-1]).median())
    return per_rep.min(dim=1).values.tolist(), paired


def _worker(rank: int, nproc: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    from .allreduce import ALL_REDUCE_ALGORITHMS
    from .collectives import ALGORITHMS
    from .cost import calibrate

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, nproc, is_master=rank == 0, timeout=timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nproc, timeout=timedelta(seconds=600))
    coll = args.collective
    every = ALL_REDUCE_ALGORITHMS if coll == "all_reduce" else ALGORITHMS[coll]
    algs = [a for a in (args.algorithms or list(every) + ["auto"]) if a != "native"]
    sizes = parse_sizes(args.sizes)
    model = calibrate(large=max(4 << 20, min(max(sizes), 64 << 20)), collectives=(coll,))
    rows, picks = [], {}
    for size in sizes:
        native = run_collective(coll, "native", size, None, nproc)
        timed: dict[str, tuple[float, float, float]] = {}  # algorithm -> (its time, native's beside, paired)
        for alg in algs:
            if alg == "auto":
                fn, pick = _auto_closure(coll, size, model, nproc)
                (t_native, t), paired = _measure([native, fn], args.reps, None)
                picks[size] = pick()
                timed["auto"] = (t, t_native, paired)
                continue
            real = alg
            if real not in timed:
                if real == "native":
                    (t,), _ = _measure([native], args.reps, None)
                    timed[real] = (t, t, 1.0)
                else:
                    closure = run_collective(coll, real, size, None, nproc)
                    (t_native, t), paired = _measure([native, closure], args.reps, None)
                    timed[real] = (t, t_native, paired)
        natives = [tn for _, tn, _ in timed.values()]
        timed["native"] = (statistics.median(natives), statistics.median(natives), 1.0)
        for alg in ["native", *algs]:
            real = picks[size] if alg == "auto" else alg
            t, t_native, paired = timed[alg if alg == "auto" else real]
            pred = model.predict(coll, real, size)
            algbw = size / t / 1e9
            rows.append({"size": size, "algorithm": alg, "chosen": real, "time_us": t * 1e6, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * BUS_FACTOR[coll](nproc), "predicted_us": pred * 1e6,
                         "prediction_error": pred / t - 1, "native_beside_us": t_native * 1e6,
                         "ratio_to_native": t_native / t, "paired_ratio_to_native": paired})
    if rank == 0:
        result = {"collective": coll, "nproc": nproc, "backend": "gloo", "reps": args.reps,
                  "model": {"alpha_s": model.alpha, "beta_s_per_byte": model.beta, "gamma_s_per_byte": model.gamma,
                            "native": model.native, "efficiency": model.efficiency, "overhead_s": model.overhead,
                            "delta_s_per_byte": model.delta,
                            "margin": model.margin},
                  "auto_picks": {str(k): v for k, v in picks.items()}, "rows": rows}
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    shutdown_distributed()


def _human(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def table(result: dict) -> str:
    """The human-readable (markdown) table of one benchmark result."""
    lines = [f"{result['collective']} on {result['nproc']} gloo ranks (best of {result['reps']})", "",
             "| size | algorithm | time (us) | busbw (GB/s) | native beside (us) | x native busbw | paired median "
             "| predicted (us) | pred. error |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        alg = r["algorithm"] + (f" -> {r['chosen']}" if r["algorithm"] == "auto" else "")
        lines.append(f"| {_human(r['size'])} | {alg} | {r['time_us']:.0f} | {r['busbw_GBps']:.3f} | "
                     f"{r['native_beside_us']:.0f} | {r['ratio_to_native']:.2f} | "
                     f"{r.get('paired_ratio_to_native', float('nan')):.2f} | {r['predicted_us']:.0f} | "
                     f"{r['prediction_error']:+.0%} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """One markdown table over several results (e.g. 2 and 4 ranks): per algorithm and size,
    busbw as a multiple of native's and the cost model's prediction error; then auto's picks."""
    sizes = sorted({r["size"] for res in results for r in res["rows"]})
    head = " | ".join(f"{res['nproc']} ranks {_human(s)}" for res in results for s in sizes)
    lines = [f"| algorithm | {head} |", "|---|" + "---:|" * (len(results) * len(sizes))]
    algs = list(dict.fromkeys(r["algorithm"] for res in results for r in res["rows"]))
    for alg in algs:
        cells = []
        for res in results:
            by_size = {r["size"]: r for r in res["rows"] if r["algorithm"] == alg}
            for s in sizes:
                r = by_size.get(s)
                if r is None:
                    cells.append("")
                elif alg == "auto":
                    cells.append(f"{r['ratio_to_native']:.2f}x ({r['chosen']})")
                elif alg == "native":
                    cells.append(f"1.00x ({r['busbw_GBps']:.2f} GB/s, {r['prediction_error']:+.0%})")
                else:
                    cells.append(f"{r['ratio_to_native']:.2f}x ({r['prediction_error']:+.0%})")
        lines.append(f"| {alg} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for alg in dict.fromkeys(r["algorithm"] for r in result["rows"]):
        pts = [(r["size"], r["busbw_GBps"]) for r in result["rows"] if r["algorithm"] == alg]
        style = {"color": "black", "linestyle": "--", "zorder": 5} if alg == "native" else \
            {"linestyle": ":", "marker": "x"} if alg == "auto" else {}
        ax.plot(*zip(*pts, strict=True), **{"marker": "o", "label": alg, **style})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{result['collective']}, {result['nproc']} gloo ranks")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from .allreduce import ALL_REDUCE_ALGORITHMS
    from .collectives import ALGORITHMS

    p = argparse.ArgumentParser(prog="shardwise bench comm", description=__doc__.split("\n\n")[0])
    p.add_argument("--collective", default="all_reduce", choices=["all_reduce", *ALGORITHMS])
    p.add_argument("--algorithms", nargs="+", help="default: every algorithm of the collective, and auto")
    p.add_argument("--sizes", default="4K..64M", help='"4K..64M" (powers of 4) or a list "4K,1M,16M"')
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="PATH", nargs="?", const="-", help="write JSON (to stdout with no PATH)")
    p.add_argument("--plot", metavar="PNG", help="bandwidth-vs-size plot")
    p.add_argument("--summarize", metavar="JSON", nargs="+",
                   help="print one summary table of earlier --json results instead of running")
    add_machine_note(p)
    args = p.parse_args(argv)
    if args.summarize:
        print(summary([json.load(open(path)) for path in args.summarize]))
        return 0
    valid = (ALL_REDUCE_ALGORITHMS if args.collective == "all_reduce" else ALGORITHMS[args.collective]) + ("auto",)
    bad = [a for a in args.algorithms or [] if a not in valid]
    if bad or args.nproc < 2:
        msg = f"--algorithms {bad} not valid; use {', '.join(valid)}" if bad else "--nproc must be >= 2"
        print(f"error: {msg}", file=sys.stderr)
        return 2
    try:
        parse_sizes(args.sizes)
    except ValueError:
        print(f"error: --sizes {args.sizes!r} is not valid; e.g. 4K..64M or 4K,1M,16M", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    to_file = args.json if args.json and args.json != "-" else None
    bench_run = BenchRun.start("shardwise bench comm", argv, args, output=to_file)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(args.nproc, port, args, out), nprocs=args.nproc, start_method="spawn")
        with open(out) as f:
            result = json.load(f)
    if args.json == "-":
        print(json.dumps(result, indent=1))
    else:
        print(table(result))
        if to_file:
            bench_run.write(to_file, result)
    if args.plot:
        plot(result, args.plot)
    return 0
