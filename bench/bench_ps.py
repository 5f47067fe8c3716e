"""Benchmark: the parameter server's consistency modes under a straggler, and bsp against all-reduce.

Each variant is one ``shardwise train`` run (gloo, CPU) of the same model, data and global batch, with
worker 1 delayed per step by ``--straggler-factor`` times the median step time of a first, undelayed
all-reduce run (the issue's "2x the step"). Variants: all-reduce data parallelism (no servers, no
straggler), bsp, ssp with s = 1 and s = 3, asp. From each run's own logs (``metrics.jsonl``,
``ps/worker<r>.jsonl``) it reports:

* throughput: optimizer steps per second of the fast workers (steps / their wall time);
* the validation loss at the end of the same number of steps, and the wall time it took;
* bytes per worker per step: pushed + pulled (measured from the tensors sent and received), against
  all-reduce's ``comm_bytes`` (what the all-reduce was handed; its ring moves 2(n-1)/n of it);
* a plot of worker 0's loss against wall time per variant (``--plot``);
* for bsp and each ssp(s), the validation loss of the deterministic one-process reference
  (:mod:`shardwise.ps.delayed`): the same training with the fast workers' gradients exactly s clocks stale,
  which under a straggler is what ssp computes (``tests/test_ps.py`` pins it to 1e-5) -- it separates what
  staleness costs the optimizer from anything the timing of a run adds;
* the training loss of each variant at the same wall time (the shortest run's), read off its curve.

The all-reduce run has no straggler (``ps.straggler`` is a parameter-server field): its row is the
synchronous baseline, which a straggler would slow by its whole delay every step, as it slows bsp.

    python bench/bench_ps.py --workers 2 --servers 1 --steps 60 \\
        --json bench/results/ps.json --plot bench/results/ps_loss_time.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.bench_result import BenchRun, add_machine_note

RESULTS = Path(__file__).resolve().parent / "results"


def train(run_dir: Path, nproc: int, args, extra: dict[str, str]) -> None:
    overrides_ = {**overrides(run_dir, nproc, args), **extra}
    cli = "import sys; from shardwise.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "train"] + [a for k, v in overrides_.items() for a in (f"--{k}", v)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=os.environ.copy())


def overrides(run_dir: Path, nproc: int, args) -> dict[str, str]:
    return {"model.preset": args.preset, "data.max_bytes": str(args.max_bytes), "train.steps": str(args.steps),
            "train.global_batch": str(args.global_batch), "train.precision": "fp32", "train.lr": str(args.lr),
            "train.eval_every": "0", "ckpt.every": "0", "parallel.nproc": str(nproc), "run.device": "cpu",
            "run.dir": str(run_dir), "run.progress": "false", "run.tensorboard": "false"}


def delayed_val_loss(run_dir: Path, args, staleness: int) -> float | None:
    """Validation loss of one process training with worker 0..W-2's gradients ``staleness`` clocks old
    and the straggler's (worker 1's) fresh -- the trajectory of ssp(s) under the benchmark's straggler."""
    from shardwise.config import Config
    from shardwise.launch import prepare_run
    from shardwise.ps.delayed import train_delayed

    cfg, _ = prepare_run(Config.load(overrides=overrides(run_dir, args.workers, args)))
    delays = [0 if w == 1 else staleness for w in range(args.workers)]
    return train_delayed(cfg, run_dir, delays).val_loss


def loss_at(curve: list[tuple[float, float]], t: float, window: int = 5) -> float:
    """The mean training loss of the last ``window`` steps done by wall time ``t``."""
    done = [loss for when, loss in curve if when <= t][-window:]
    return sum(done) / len(done) if done else float("nan")


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def summarize(run_dir: Path, n_workers: int, ps: bool) -> dict:
    main = lines(run_dir / "metrics.jsonl")
    steps = [r for r in main if "loss" in r]
    val = [r["val_loss"] for r in main if "val_loss" in r]
    out = {"final_val_loss": val[-1] if val else None, "steps": len(steps)}
    if not ps:
        times = [r["step_time_s"] for r in steps]
        out.update(wall_s=sum(times), steps_per_s_fast=len(times) / sum(times),
                   bytes_per_worker_step=statistics.median(r.get("comm_bytes", 0.0) for r in steps),
                   curve=[(sum(times[:i + 1]), r["loss"]) for i, r in enumerate(steps)])
        return out
    workers = [lines(run_dir / "ps" / f"worker{r}.jsonl") for r in range(n_workers)]
    walls = [sum(r["step_time_s"] for r in w) for w in workers]
    fast = [len(w) / wall for w, wall in zip(workers, walls, strict=True)]
    rec0 = workers[0]
    t = 0.0
    curve = []
    for r in rec0:
        t += r["step_time_s"]
        curve.append((t, r.get("worker_loss", r["loss"])))
    out.update(wall_s=max(walls), steps_per_s_fast=statistics.mean(f for i, f in enumerate(fast) if i != 1),
               bytes_per_worker_step=statistics.median(r["ps_bytes_pushed"] + r["ps_bytes_pulled"] for r in rec0),
               staleness_max=max(r["ps_staleness_max"] for r in rec0),
               wait_s=sum(r["ps_wait_s"] for r in rec0),
               overlap=statistics.mean(r["ps_push_overlap_frac"] for r in rec0),
               curve=curve)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--max-bytes", type=int, default=2_000_000)
    ap.add_argument("--straggler-factor", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--modes", default="bsp,ssp1,ssp3,asp")
    ap.add_argument("--json", type=Path, default=RESULTS / "ps.json")
    ap.add_argument("--plot", type=Path, default=None)
    add_machine_note(ap)
    args = ap.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "allreduce"
        train(base, args.workers, args, {})
        results["allreduce"] = summarize(base, args.workers, ps=False)
        step_ms = 1000 * results["allreduce"]["wall_s"] / max(1, results["allreduce"]["steps"])
        delay = f"1:{args.straggler_factor * step_ms:.0f}"
        for mode in args.modes.split(","):
            extra = {"ps.servers": str(args.servers), "ps.straggler": delay,
                     "ps.consistency": "ssp" if mode.startswith("ssp") else mode}
            if mode.startswith("ssp"):
                extra["ps.staleness"] = mode[3:]
            run_dir = Path(tmp) / mode
            train(run_dir, args.workers + args.servers, args, extra)
            results[mode] = summarize(run_dir, args.workers, ps=True)
            if mode == "bsp" or mode.startswith("ssp"):
                results[mode]["delayed_reference_val_loss"] = delayed_val_loss(
                    Path(tmp) / f"delayed-{mode}", args, int(mode[3:] or 0) if mode.startswith("ssp") else 0)
    same_time = min(r["wall_s"] for r in results.values())
    for r in results.values():
        r["loss_at_same_time"] = loss_at(r["curve"], same_time)
    n = args.workers
    print(f"{args.workers} workers, {args.servers} server(s), straggler delay {delay} ms/step, {args.steps} steps")
    print(f"{'variant':10} {'steps/s fast':>12} {'wall s':>8} {'val loss':>9} {'delayed ref':>11} "
          f"{f'loss@{same_time:.0f}s':>9} {'MB/worker/step':>15} {'stale max':>9}")
    nan = float("nan")
    for name, r in results.items():
        ref = r.get("delayed_reference_val_loss")
        print(f"{name:10} {r['steps_per_s_fast']:12.2f} {r['wall_s']:8.1f} {r['final_val_loss'] or nan:9.4f} "
              f"{nan if ref is None else ref:11.4f} {r['loss_at_same_time']:9.4f} "
              f"{r['bytes_per_worker_step'] / 1e6:15.2f} {r.get('staleness_max', 0):9.0f}")
    print(f"all-reduce ring puts 2(n-1)/n = {2 * (n - 1) / n:.2f} x M on the wire per worker; "
          "a parameter-server worker pushes M and pulls M")
    bench_run.write(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "delay": delay,
                                "results": results})
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in results.items():
            ax.plot(*zip(*r["curve"], strict=True), label=name)
        ax.set_xlabel("wall time of worker 0 (s)")
        ax.set_ylabel("training loss (worker 0's batch)")
        ax.set_title(f"parameter server, {args.workers} workers, straggler {args.straggler_factor:g}x step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
