"""Benchmark: generation with the key/value cache against recomputing the context every step.

The same model (a trained run's, or a preset's seeded initialisation), the same batch of prompts, greedy
decoding; both paths must give the same tokens (checked), and the report is tokens/s of each and their
ratio. Rounds alternate the two so drift hits both.

    python bench/bench_generate.py --preset cpu-demo --batch 1 4 --new-tokens 100
    python bench/bench_generate.py --run-dir runs/latest --batch 4
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from shardwise.bench_result import BenchRun, add_machine_note

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"


def build_model(args):
    if args.run_dir:
        from shardwise.generate_run import load_trained_model

        return load_trained_model(Path(args.run_dir))[0]
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer

    cfg = resolve(Config.load(overrides={"model.preset": args.preset, "parallel.nproc": "1"}), tokenizer_vocab=257)
    model = Transformer(cfg.model)
    model.reset_parameters(seed=0)
    return model


def timed(model, prompts, new_tokens: int, use_cache: bool) -> tuple[float, list[list[int]]]:
    from shardwise.model import generate_batch

    t0 = time.perf_counter()
    out = generate_batch(model, prompts, new_tokens, temperature=0.0, use_cache=use_cache)
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--run-dir", help="a trained run (default: the preset, seeded)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS)
    add_machine_note(parser)
    args = parser.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)

    model = build_model(args).eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            prompts = [torch.randint(0, 256, (args.prompt_len + 3 * r,), generator=g).tolist() for r in range(batch)]
            times = {True: [], False: []}
            outputs = {}
            for _ in range(args.rounds):
                for use_cache in (False, True):
                    seconds, outputs[use_cache] = timed(model, prompts, args.new_tokens, use_cache)
                    times[use_cache].append(seconds)
            assert outputs[True] == outputs[False], "the cached and uncached paths gave different tokens"
            tokens = batch * args.new_tokens
            cached, plain = tokens / statistics.median(times[True]), tokens / statistics.median(times[False])
            rows.append({"batch": batch, "new_tokens": args.new_tokens, "cache_tokens_per_s": cached,
                         "no_cache_tokens_per_s": plain, "speedup": cached / plain})
            print(f"batch {batch}: {cached:,.0f} tokens/s with the cache, {plain:,.0f} without ({cached / plain:.2f}x)")
    report = {"host": platform.node(), "threads": torch.get_num_threads(),
              "model": args.run_dir or args.preset, "max_seq_len": model.cfg.max_seq_len, "rows": rows}
    bench_run.write(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
