"""Benchmark: the trainer's step with many small experts against a dense model of the same active FLOPs.

One process, our trainer (``shardwise.train.loop.train``, what ``shardwise train`` runs in each worker) on the
built-in corpus, bf16 autocast: the default model (``cpu-demo``: 4 blocks, d 256, MLP width 1024) against
the same model whose every MLP is a mixture of ``--experts`` experts top-``--top-k`` of width
``1024 / top-k`` -- the same multiply-adds per token in the experts, plus the router's ``d x E``. Runs
alternate dense / MoE for ``--rounds`` rounds; reported: the median step time each logged (``step_time_s``,
after ``--warmup`` steps) and the CPU seconds of each run's steps (``time.process_time`` around the run /
steps), the ratio MoE / dense of both (target <= 1.3), and the losses.

    python bench/bench_moe_step.py --experts 64 --top-k 8

Results go to bench/results/moe_step.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from trainer_bench import run_trainer, trainer_config  # noqa: E402

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

RESULTS = REPO / "bench" / "results" / "moe_step.json"


def overrides(args, moe: bool) -> dict:
    out = {"model.preset": "cpu-demo", "train.precision": args.precision}
    if moe:
        out.update({"model.n_experts": args.experts, "model.moe_top_k": args.top_k,
                    "model.moe_d_ff": args.dense_width // args.top_k})
    return out


def one_run(args, moe: bool, root: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    cfg = trainer_config(run_dir, "cpu", args.steps + 1, args.batch, overrides(args, moe), args.max_bytes,
                         cache_dir=str(root / "cache"))
    c0 = time.process_time()
    out = run_trainer(cfg, args.warmup)
    out["cpu_s_per_step"] = (time.process_time() - c0) / args.steps
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dense-width", type=int, default=1024, help="the dense MLP's width (cpu-demo: 4 d)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--max-bytes", type=int, default=2_000_000)
    ap.add_argument("--json", type=Path, default=RESULTS)
    add_machine_note(ap)
    args = ap.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    import torch

    runs: dict[str, list[dict]] = {"dense": [], "moe": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in (("dense", "moe") if r % 2 == 0 else ("moe", "dense")):
                got = one_run(args, name == "moe", Path(tmp))
                runs[name].append(got)
                print(f"round {r} {name:5s}: step {got['step_time_s'] * 1e3:7.1f} ms, cpu/step "
                      f"{got['cpu_s_per_step'] * 1e3:7.1f} ms, loss {got['final_loss']:.3f}", flush=True)
    med = {k: {"step_time_s": statistics.median(x["step_time_s"] for x in v),
               "cpu_s_per_step": statistics.median(x["cpu_s_per_step"] for x in v),
               "final_loss": v[-1]["final_loss"]} for k, v in runs.items()}
    result = {"benchmark": f"trainer step: {args.experts} experts top-{args.top_k} vs dense, same active FLOPs",
              "host": platform.node(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "median": med, "runs": runs,
              "ratio_step_time": med["moe"]["step_time_s"] / med["dense"]["step_time_s"],
              "ratio_cpu": med["moe"]["cpu_s_per_step"] / med["dense"]["cpu_s_per_step"]}
    print(f"MoE / dense: step time {result['ratio_step_time']:.3f}, cpu {result['ratio_cpu']:.3f}")
    bench_run.write(args.json, result)


if __name__ == "__main__":
    main()
