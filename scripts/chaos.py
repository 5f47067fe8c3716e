"""Fault-injection soak: random faults over several layouts, every run must survive them bit for bit.

For each layout (dp 2, ZeRO-3, tp 2 x pp 2, cp 2, ep 2) one uninterrupted run, then one run with
``--faults`` faults drawn at random (``shardwise.train.faults.draw_faults``: kill, stop, hang, raise, or a
kill while a checkpoint is written; a random rank; a random step the attempt reaches), one per restart
attempt, under ``run.max_restarts``. Each faulted run must

* end by itself, exit 0 (a hung or stopped rank is found by its peers within ``parallel.timeout_s``);
* have restarted once per fault (``metrics.jsonl``'s restart records);
* hold final weights bit-identical to the uninterrupted run's;
* leave no partial checkpoint directory (``.tmp-*``).

A fault counts as survived when its run meets all four. Runs go through the real command line
(``python -m shardwise.cli train``: torch's elastic agent, real processes and signals). It takes minutes,
more than the test suite's budget: ``tests/test_chaos.py`` checks the pieces (the drawing, the check of a
run, a disk that fills during a checkpoint) and this script is the soak:

    python scripts/chaos.py --faults 4 --seed 0 --json bench/results/chaos.json
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardwise.bench_result import BenchRun, add_machine_note

BASE = {
    "model.preset": "tiny", "data.source": "stdlib", "data.max_bytes": "400000", "data.seq_len": "32",
    "train.steps": "8", "train.global_batch": "8", "train.warmup_steps": "2", "train.precision": "fp32",
    "train.eval_every": "0", "train.eval_batches": "2", "ckpt.every": "2", "ckpt.keep": "2",
    "parallel.timeout_s": "10", "run.progress": "false", "run.tensorboard": "false",
}
LAYOUTS = {
    "dp2": {"parallel.nproc": "2"},
    "zero3": {"parallel.nproc": "2", "parallel.zero": "3"},
    "tp2-pp2": {"parallel.nproc": "4", "parallel.tp": "2", "parallel.pp": "2", "parallel.microbatches": "2"},
    "cp2": {"parallel.nproc": "2", "parallel.cp": "2"},
    "ep2": {"parallel.nproc": "2", "model.preset": "tiny-moe", "parallel.ep": "2"},
}


def launch(run_dir: Path, cache: Path, overrides: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """``shardwise train`` with ``overrides`` into ``run_dir`` (one thread per worker)."""
    args = [a for k, v in {**BASE, "data.cache_dir": str(cache), "run.dir": str(run_dir), **overrides}.items()
            for a in (f"--{k}", v)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


def check_run(run_dir: Path, reference: Path, n_faults: int) -> list[str]:
    """What is wrong with a faulted run against the uninterrupted one (empty: it survived)."""
    import torch

    from shardwise.train.checkpoint import list_checkpoints
    from shardwise.train.metrics import read_metrics
    from shardwise.train.state import open_checkpoint

    problems = []
    restarts = [r for r in read_metrics(run_dir, raw=True) if "restart" in r]
    if len(restarts) != n_faults:
        problems.append(f"{len(restarts)} restart(s) for {n_faults} fault(s)")
    partial = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    if partial:
        problems.append(f"partial checkpoint directories left: {partial}")
    mine, theirs = (list_checkpoints(d / "checkpoints")[-1] for d in (run_dir, reference))
    if mine.name != theirs.name:
        problems.append(f"newest checkpoint {mine.name}, the uninterrupted run's {theirs.name}")
    a, b = open_checkpoint(mine).model_state(), open_checkpoint(theirs).model_state()
    differ = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
    if differ:
        problems.append(f"{len(differ)} tensor(s) differ from the uninterrupted run, e.g. {differ[0]}")
    return problems


def soak(layouts: list[str], n_faults: int, seed: int, work: Path, timeout_s: float, log=print) -> dict:
    from shardwise.train.faults import draw_faults, fault_text

    rng = random.Random(seed)
    steps, every = int(BASE["train.steps"]), int(BASE["ckpt.every"])
    out = {"seed": seed, "faults_per_run": n_faults, "runs": [], "tried": 0, "survived": 0}
    for name in layouts:
        layout = LAYOUTS[name]
        faults = draw_faults(rng, n_faults, steps, every, int(layout["parallel.nproc"]))
        spec = fault_text(faults)
        t0 = time.monotonic()
        ref = launch(work / f"{name}-reference", work / "cache", layout, timeout_s)
        t1 = time.monotonic()
        run = launch(work / name, work / "cache", {**layout, "run.fault": spec,
                                                   "run.max_restarts": str(len(faults))}, timeout_s)
        t2 = time.monotonic()
        problems = [f"uninterrupted run failed: {ref.stderr.strip()[-300:]}"] if ref.returncode else []
        if run.returncode:
            problems.append(f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")
        if not problems:
            problems = check_run(work / name, work / f"{name}-reference", len(faults))
        survived = 0 if problems else len(faults)
        out["runs"].append({"layout": name, "faults": spec, "tried": len(faults), "survived": survived,
                            "problems": problems, "reference_s": round(t1 - t0, 1), "faulted_s": round(t2 - t1, 1)})
        out["tried"] += len(faults)
        out["survived"] += survived
        log(f"{name}: {spec}: {'survived' if not problems else '; '.join(problems)} "
            f"({t2 - t1:.0f} s, uninterrupted {t1 - t0:.0f} s)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--faults", type=int, default=4, help="faults per faulted run (one per restart attempt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds one launch may take before it counts as hung")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--keep", type=Path, help="keep the runs in this directory (default: a temporary one)")
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    with tempfile.TemporaryDirectory(prefix="shardwise-chaos-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        summary = soak(args.layouts, args.faults, args.seed, work, args.timeout)
    print(f"faults tried {summary['tried']}, survived {summary['survived']}")
    if args.json:
        bench_run.write(args.json, summary)
    return 0 if summary["tried"] == summary["survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
