"""Benchmark: framework overhead -- the trainer's step against a plain PyTorch training loop.

One process, one model, the same batches. "ours" is the path users run: ``shardwise.train.loop.train``
on the resolved config (engine, data-parallel wrapper of one rank, metrics, learning-rate schedule,
memory sampling on its steps), its step time read from the ``step_time_s`` it logs. "plain" is the
loop a PyTorch user writes by hand for the same model: the same windows in the same order, autocast,
``loss.backward()``, ``clip_grad_norm_``, ``AdamW.step()``, ``zero_grad``, timed with the same clock
around the same work (batch fetch to the end of the step). Rounds alternate plain / ours so drift hits
both; the report is the ratio of the median step times (target <= 1.03) and the losses of both runs,
which must agree (same initialisation, data and optimizer).

    python bench/bench_overhead.py --steps 30 --rounds 2
    python bench/bench_overhead.py --json bench/results/overhead.json   # the default output
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shardwise.bench_result import BenchRun, add_machine_note

RESULTS = Path(__file__).resolve().parent / "results" / "overhead.json"


def make_config(args, run_dir: Path):
    from shardwise.config import Config

    overrides = {"model.preset": args.preset, "train.steps": str(args.steps), "train.precision": args.precision,
                 "train.global_batch": str(args.batch), "train.eval_every": "0", "ckpt.every": "0",
                 "parallel.nproc": "1", "run.dir": str(run_dir), "run.progress": "false",
                 "run.tensorboard": "false", "data.max_bytes": str(args.max_bytes)}
    return Config.load(overrides=overrides)


def run_ours(args, root: Path) -> tuple[list[float], list[float]]:
    """The trainer in this process (a one-rank group); its own logged step times and losses."""
    import torch.distributed as dist

    from shardwise.config_resolve import resolve
    from shardwise.data import prepare_corpus
    from shardwise.train.loop import train

    run_dir = Path(tempfile.mkdtemp(dir=root))
    cfg = make_config(args, run_dir)
    corpus = prepare_corpus(cfg.data, run_dir)
    cfg = resolve(cfg, world_size=1, tokenizer_vocab=corpus.vocab_size)
    train(cfg, run_dir)
    dist.destroy_process_group()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    return [r["step_time_s"] for r in rows], [r["loss"] for r in rows]


def run_plain(args, root: Path) -> tuple[list[float], list[float]]:
    """A hand-written PyTorch loop over the same model, windows, schedule and optimizer settings."""
    from shardwise.config_resolve import resolve
    from shardwise.data import DistributedWindowSampler, TokenWindows, prepare_corpus
    from shardwise.model import Transformer
    from shardwise.train.optim import build_optimizer, lr_at, set_lr

    run_dir = Path(tempfile.mkdtemp(dir=root))
    cfg = make_config(args, run_dir)
    corpus = prepare_corpus(cfg.data, run_dir)
    cfg = resolve(cfg, world_size=1, tokenizer_vocab=corpus.vocab_size)
    t = cfg.train
    windows = TokenWindows(corpus.train_path, cfg.data.seq_len)
    sampler = DistributedWindowSampler(len(windows), t.global_batch, t.seed, 0, 1)
    torch.manual_seed(t.seed)
    model = Transformer(cfg.model)
    model.reset_parameters(t.seed)
    opt = build_optimizer(model, t)  # AdamW with the usual decay / no-decay groups
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    times, losses = [], []
    for step in range(t.steps):
        t0 = time.perf_counter()
        set_lr(opt, lr_at(step, t))
        total = 0.0
        micro = list(sampler.micro_batches(step, t.micro_batch))
        for ids in micro:
            x, y = windows.batch(ids)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(x, y)
            (loss / len(micro)).backward()
            total += loss.item()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(total / len(micro))
    return times, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="steps of each run left out of the medians")
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus bytes to tokenize (data.max_bytes)")
    ap.add_argument("--json", default=str(RESULTS))
    add_machine_note(ap)
    args = ap.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json or None)
    torch.set_num_threads(torch.get_num_threads())
    steps = {"plain": [], "ours": []}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, fn in (("plain", run_plain), ("ours", run_ours)):
                times, loss = fn(args, Path(tmp))
                steps[name] += times[args.warmup:]
                losses[name] = loss
    med = {k: statistics.median(v) for k, v in steps.items()}
    diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["ours"], strict=True))
    out = {
        "benchmark": "framework overhead: shardwise train (1 process) vs a plain PyTorch loop",
        "host": platform.node(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args),
        "step_s_median": med, "ratio_ours_over_plain": med["ours"] / med["plain"],
        "max_loss_difference": diff, "losses_finite": all(math.isfinite(x) for x in losses["ours"]),
    }
    print(f"median step: plain {med['plain'] * 1e3:.1f} ms, ours {med['ours'] * 1e3:.1f} ms, "
          f"ratio {out['ratio_ours_over_plain']:.3f} (target <= 1.03); max loss difference {diff:.2e}")
    if args.json:
        bench_run.write(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
