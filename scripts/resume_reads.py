"""Bytes each rank reads when a run resumes, per layout: dp 4, ZeRO-3 dp 4, tp 2 x pp 2 (4 gloo ranks).

Each layout trains one step of a small GPT with a checkpoint after it, then resumes from that checkpoint in a
copy of its run directory. The bytes are counted by the trainer's own checkpoint reader
(``TrainResult.resume_bytes_read``: safetensors headers, every tensor entry read -- each verified against its
digest as it is read -- and ``manifest.json`` / ``state.json``), so the figure does not depend on the page
cache. The launcher's check before the resume (``shardwise.run_dir.check_resume``) reads no shard; what it
reads is reported too (counted by wrapping the one function that hashes a file).

    python scripts/resume_reads.py                        # d_model 256, 4 blocks
    python scripts/resume_reads.py --d-model 512 --layers 8 --json bench/results/resume_reads.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from shardwise.bench_result import BenchRun, add_machine_note

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"dp4": {}, "zero3-dp4": {"parallel.zero": 3},
           "tp2-pp2": {"parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 2}}


def _train(cfg, run_dir: str) -> dict[str, int]:
    """Rank body: train (or resume) ``cfg``; the bytes this rank read of the checkpoint it resumed from."""
    from shardwise.train.loop import train

    return train(cfg, Path(run_dir)).resume_bytes_read


def _config(run_dir: Path, cache: Path, args, layout: dict, resume: bool):
    from shardwise.config import Config
    from shardwise.launch import prepare_run

    overrides = {"model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": args.layers,
                 "model.d_model": args.d_model, "model.n_heads": 8, "model.max_seq_len": 64, "data.seq_len": 32,
                 "data.source": "stdlib", "data.max_bytes": 400000, "data.cache_dir": str(cache),
                 "train.steps": 1, "train.global_batch": 4, "train.eval_batches": 1, "ckpt.every": 1,
                 "parallel.nproc": 4, "run.dir": str(run_dir), "run.progress": "false", "run.tensorboard": "false",
                 "ckpt.resume": "true" if resume else "false", **layout}
    return prepare_run(Config.load(overrides={k: str(v) for k, v in overrides.items()}))[0]


def launcher_reads(run_dir: Path, cfg) -> int:
    """Bytes the launcher's pre-resume check hashes (it reads the manifest besides: a few kB)."""
    from shardwise import run_dir as policy
    from shardwise.train import checkpoint

    counted = []
    real = checkpoint.file_sha256

    def counting(path):
        size, digest = real(path)
        counted.append(size)
        return size, digest

    checkpoint.file_sha256 = counting
    try:
        policy.check_resume(run_dir, cfg, log=lambda _line: None)
    finally:
        checkpoint.file_sha256 = real
    return sum(counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    add_machine_note(parser)
    args = parser.parse_args()
    bench_run = BenchRun.start(__file__, None, args, output=args.json)
    sys.path.insert(0, str(ROOT))
    from tests.harness import run_on_ranks, shutdown_pools

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            for name, layout in LAYOUTS.items():
                run_dir = tmp / name
                run_on_ranks(4, _train, _config(run_dir, tmp / "cache", args, layout, False), str(run_dir))
                again = tmp / f"{name}-resumed"
                shutil.copytree(run_dir, again)
                cfg = _config(again, tmp / "cache", args, layout, True)
                checkpoint = again / "checkpoints" / "step_00000001"
                size = sum(p.stat().st_size for p in checkpoint.iterdir())
                launcher = launcher_reads(again, cfg)
                for rank, read in enumerate(run_on_ranks(4, _train, cfg, str(again))):
                    shards = sum(v for k, v in read.items() if k.startswith("shard-"))
                    total = sum(read.values())
                    rows.append({"layout": name, "rank": rank, "checkpoint_bytes": size, "read_bytes": total,
                                 "shard_bytes": shards, "small_file_bytes": total - shards,
                                 "launcher_hashed_bytes": launcher})
        finally:
            shutdown_pools()
    print(f"{'layout':<10} {'rank':>4} {'checkpoint':>12} {'read':>12} {'of it shards':>13} {'fraction':>9}")
    for r in rows:
        print(f"{r['layout']:<10} {r['rank']:>4} {r['checkpoint_bytes']:>12,} {r['read_bytes']:>12,} "
              f"{r['shard_bytes']:>13,} {r['read_bytes'] / r['checkpoint_bytes']:>9.3f}")
    for name in LAYOUTS:
        launcher = next(r["launcher_hashed_bytes"] for r in rows if r["layout"] == name)
        print(f"{name}: the launcher's check hashed {launcher:,} bytes (state.json)")
    if args.json:
        bench_run.write(args.json, {"d_model": args.d_model, "layers": args.layers, "rows": rows})


if __name__ == "__main__":
    main()
