"""Benchmark: the training time a checkpoint costs, asynchronous (``ckpt.async``) against synchronous.

Two runs of the same model and layout, one with ``ckpt.async true`` and one without, each ``shardwise train``
on 2 ranks with ZeRO-3 (so every rank writes its half of the parameters and of Adam's moments: >= 100 MB per
rank by default), a checkpoint every ``--every`` steps. From each run's ``metrics.jsonl``: ``ckpt_stall_s``
(training time lost at a checkpoint step, measured by the trainer, plus ``ckpt_wait_s``: optimizer steps that
waited for the background copy), ``ckpt_write_s`` (the write itself) and the
step time of the steps right after a checkpoint (the background write competes with them for the CPU). The
report is the median stall of each and their ratio (async / sync), with the bytes each rank wrote.

    python bench/bench_ckpt.py                      # d_model 512, 6 blocks: ~114 MB per rank
    python bench/bench_ckpt.py --d-model 768 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.bench_result import BenchRun, add_machine_note

RESULTS = Path(__file__).resolve().parent / "results" / "ckpt.json"


def train(run_dir: Path, args, asynchronous: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--run.dir", str(run_dir), "--parallel.nproc", "2",
           "--parallel.zero", "3", "--model.preset", "custom", "--model.flavor", "gpt2",
           "--model.n_layers", str(args.layers), "--model.d_model", str(args.d_model), "--model.n_heads", "8",
           "--model.max_seq_len", "128", "--data.seq_len", "128", "--data.max_bytes", "2000000",
           "--train.steps", str(args.steps), "--train.global_batch", "8", "--train.eval_every", "0",
           "--train.eval_batches", "1", "--ckpt.every", str(args.every), "--ckpt.keep", "2",
           "--ckpt.async", "true" if asynchronous else "false", "--run.progress", "false",
           "--run.tensorboard", "false", "--run.max_restarts", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(rows: list[dict], every: int) -> dict:
    """Per checkpoint, the training time it cost: its ``ckpt_stall_s`` plus the ``ckpt_wait_s`` of the optimizer
    steps that waited for its background copy (those before the next checkpoint)."""
    stalls = []
    for r in rows:
        if "ckpt_stall_s" in r:
            stalls.append(r["ckpt_stall_s"])
        elif "ckpt_wait_s" in r and stalls:
            stalls[-1] += r["ckpt_wait_s"]
    writes = [r["ckpt_write_s"] for r in rows if "ckpt_write_s" in r]
    steps = {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}
    after = [t for s, t in steps.items() if s > 1 and (s - 1) % every == 0]
    others = [t for s, t in steps.items() if s > 1 and (s - 1) % every != 0]
    return {"stall_s": stalls, "write_s": writes, "median_stall_s": statistics.median(stalls),
            "median_write_s": statistics.median(writes),
            "median_step_after_checkpoint_s": statistics.median(after) if after else None,
            "median_other_step_s": statistics.median(others) if others else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS)
    add_machine_note(parser)
    args = parser.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    report: dict = {"host": platform.node(), "cpus": os.cpu_count(),
                    "config": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, asynchronous in (("sync", False), ("async", True)):
            run_dir = Path(tmp) / name
            report[name] = summary(train(run_dir, args, asynchronous), args.every)
            newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
            report[name]["bytes_per_rank"] = sorted(p.stat().st_size for p in newest.glob("shard-*.safetensors"))
    ratio = report["async"]["median_stall_s"] / report["sync"]["median_stall_s"]
    report["async_over_sync_stall"] = ratio
    per_rank = min(report["sync"]["bytes_per_rank"])
    print(f"{per_rank / 1e6:,.0f} MB per rank (ZeRO-3, 2 ranks); stall per checkpoint: sync "
          f"{report['sync']['median_stall_s']:.3f} s, async {report['async']['median_stall_s']:.3f} s "
          f"(= {ratio:.1%} of sync); background write {report['async']['median_write_s']:.3f} s; step after a "
          f"checkpoint {report['async']['median_step_after_checkpoint_s']:.3f} s vs other steps "
          f"{report['async']['median_other_step_s']:.3f} s (async)")
    bench_run.write(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
