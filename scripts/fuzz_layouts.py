"""Fuzz parallel layouts: random valid configs, each trained a few steps and compared with one process.

Every draw is a tiny model under a random layout (dp, tp, sp, pp with its schedules, virtual stages, partitions
and micro-batches, cp with its algorithms and balance, ep, etp, ZeRO 1-3 with units, offload, int8 and hpZ,
recompute, dropout, gpt2 / llama with GQA / bert / MoE with each router, odd sizes, tied or not, clipping on or
off) of at most --max-ranks gloo ranks on this machine, compared with one process training the same objective
(tests/layout_fuzz.py). A refusal must be one line before any worker starts; a failing draw is shrunk to the
smallest config that still fails and printed as one command (--replay).

    python scripts/fuzz_layouts.py --n 200 --seed 1 --max-ranks 8 --json fuzz.json
    python scripts/fuzz_layouts.py --replay parallel.nproc=2 parallel.pp=2 model.n_layers=3 ...

Exit status: 0 when every draw that ran trained the one-process model, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.* (the worker pool, the comparison) import from the repository root

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20, help="configs to draw (default 20)")
    parser.add_argument("--seed", type=int, default=None, help="the draws' seed (default: from the source tree)")
    parser.add_argument("--max-ranks", type=int, default=8, help="largest world size drawn (default 8)")
    parser.add_argument("--shrink-budget", type=int, default=40, help="checks spent shrinking each failure")
    parser.add_argument("--json", type=Path, help="write the summary (counts, refusals, failures) here")
    parser.add_argument("--replay", nargs="+", metavar="FIELD=VALUE", help="check this one config and exit")
    add_machine_note(parser)
    args = parser.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)

    from tests import layout_fuzz as fuzz

    with tempfile.TemporaryDirectory(prefix="fuzz-cache-") as cache:
        if args.replay:
            outcome = fuzz.Checker(Path(cache)).check(fuzz.parse_replay(args.replay))
            print(outcome.kind + (f": {outcome.detail}" if outcome.detail else ""))
            return 0 if outcome.kind != "failed" else 1
        seed = fuzz.source_seed() if args.seed is None else args.seed
        print(f"fuzzing {args.n} layouts of <= {args.max_ranks} ranks, seed {seed}")
        t0 = time.perf_counter()
        summary = fuzz.run_campaign(args.n, seed, args.max_ranks, Path(cache), shrink_budget=args.shrink_budget,
                                    close_pools=True)
    summary.update(seconds=round(time.perf_counter() - t0, 1))
    ran = summary["equal"] + summary["failed"]
    print(f"\n{summary['drawn']} drawn: {ran} ran ({summary['equal']} equal, {summary['failed']} failed), "
          f"{summary['refused']} refused in one line; {summary['seconds']} s")
    for reason, count in sorted(summary["refusals_by_field"].items(), key=lambda kv: -kv[1]):
        print(f"  refused by {reason}: {count}")
    for failure in summary["failures"]:
        print(f"draw {failure['draw']}: {failure['shrunk_detail']}\n  {failure['shrunk']}")
    if args.json:
        bench_run.write(args.json, summary)
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
