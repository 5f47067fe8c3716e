"""Benchmark: the default run (``shardwise train``, no arguments) with and without ``train.compile``.

Runs the command a user runs, ``shardwise train --run.dir DIR`` and the same with ``--train.compile true``,
one after the other in fresh run directories (the order alternating over ``--rounds``), and reports for each
the whole run's wall time (start-up and, for the compiled one, ``torch.compile``'s compile time included), the
mean of the logged tokens/s and the final validation loss, read from the run's ``metrics.jsonl``. The built-in
corpus' token cache is shared (built by an earlier run, not inside a timed one); torch's inductor cache is not:
each run compiles into an empty one (``TORCHINDUCTOR_CACHE_DIR``), as on a fresh machine.

    python bench/bench_default_compile.py            # bench/results/default_compile.json

The README makes compile the CPU default only where the whole run is at least 15 % faster.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "default_compile.json"
if str(REPO / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO / "src"))
from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

VARIANTS = {"eager": [], "compile": ["--train.compile", "true"]}


def one_run(variant: str, root: Path, timeout_s: float) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=root)) / "run"
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--run.dir", str(run_dir), *VARIANTS[variant]]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run_dir.parent / "inductor"))  # compiled cold, every run
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tok_s = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    steps = [r["step_time_s"] for r in records if "step_time_s" in r]
    return {"wall_s": wall, "tokens_per_s_mean": statistics.fmean(tok_s) if tok_s else None,
            "first_step_s": steps[0] if steps else None, "median_step_s": statistics.median(steps) if steps else None,
            "final_val_loss": val[-1] if val else None, "command": " ".join(["shardwise", *cmd[3:]])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="runs of each variant, the order alternating")
    ap.add_argument("--timeout-s", type=float, default=1500.0, help="a run taking longer fails the benchmark")
    ap.add_argument("--json", type=Path, default=RESULTS)
    add_machine_note(ap)
    args = ap.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    import torch

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for variant in (("eager", "compile") if r % 2 == 0 else ("compile", "eager")):
                got = one_run(variant, Path(tmp), args.timeout_s)
                runs[variant].append(got)
                print(f"round {r} {variant:7s}: {got['wall_s']:.1f} s, {got['tokens_per_s_mean']:,.0f} tok/s, "
                      f"first step {got['first_step_s']:.2f} s, median {got['median_step_s']:.4f} s, val loss "
                      f"{got['final_val_loss']:.4f}", flush=True)
    wall = {v: statistics.median(x["wall_s"] for x in runs[v]) for v in VARIANTS}
    result = {"benchmark": "default run: shardwise train vs shardwise train --train.compile true",
              "host": platform.node(),
              "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "load_average_at_end": os.getloadavg(), "runs": runs, "median_wall_s": wall,
              "ratio_compile_over_eager": wall["compile"] / wall["eager"]}
    print(f"compile / eager, whole run: {result['ratio_compile_over_eager']:.3f}")
    bench_run.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
