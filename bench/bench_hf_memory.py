"""Benchmark: peak memory (RSS) of moving a model to and from Hugging Face form, against the model's size.

* **export** -- ``shardwise export RUN_DIR --format hf OUT --max-shard-size S`` of a Llama-shaped run checkpoint at
  least 8x the shard size, in a fresh process: its peak RSS (``resource.getrusage``) must stay below 2x the shard
  size (the export streams one tensor at a time, :mod:`shardwise.hf.export`);
* **import** -- ``model.init_from hf:DIR`` on 4 fresh ranks (gloo), as ZeRO-3 over 4 and as tp 2 x pp 2: each rank's
  peak RSS while the engine is built and the weights are read must stay below its share of the model (the
  model-state bytes the engine measures, :mod:`shardwise.train.memory`) + one largest tensor + the process's
  own size before the model (the fixed overhead: torch, gloo, and a tiny model started the same way first, so
  that imports, process groups and the allocator's first pages are counted there), since every rank reads only
  its slices.

The model directory and the checkpoint are written by child processes (random weights, one tensor at a time), and
every measured process is a fresh one spawned by this light parent (no torch), so none ever held the model: a
spawned process's ``ru_maxrss`` starts at its parent's RSS at the fork (the kernel keeps the pre-exec peak), so
the parent must stay small.
Results: ``bench/results/hf_memory.json``.

    python bench/bench_hf_memory.py                 # ~2 GB / ~4 GB models (a few minutes, ~5 GB of memory)
    python bench/bench_hf_memory.py --quick         # ~80 MB models (the test suite runs this)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import socket
import sys
import tempfile
from pathlib import Path

from shardwise.bench_result import BenchRun, add_machine_note

RESULTS = Path(__file__).resolve().parent / "results" / "hf_memory.json"
MB = 10**6
SIZES = {  # Llama shapes: (import model, export model, export shard size)
    "full": (dict(n_layers=10, d_model=2048, n_heads=16, n_kv_heads=4, d_ff=5632, vocab_size=32000),
             dict(n_layers=20, d_model=2048, n_heads=16, n_kv_heads=4, d_ff=5632, vocab_size=32000), 500 * MB),
    "quick": (dict(n_layers=8, d_model=512, n_heads=8, n_kv_heads=4, d_ff=1408, vocab_size=2000),
              dict(n_layers=8, d_model=512, n_heads=8, n_kv_heads=4, d_ff=1408, vocab_size=2000), 10 * MB),
}
LAYOUTS = {"zero3": {"parallel.zero": 3}, "tp2xpp2": {"parallel.tp": 2, "parallel.pp": 2}}
WARM_UP = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=300)
"""A tiny model taken through the same path first in each measured process: what that costs (imports, process
groups, the allocator's first pages) is the fixed overhead, not the model's."""


def _overrides(shape: dict, **extra) -> dict[str, str]:
    return {"model.preset": "custom", "model.flavor": "llama", "model.max_seq_len": "128", "parallel.nproc": "1",
            "run.device": "cpu", "train.precision": "fp32", **{f"model.{k}": str(v) for k, v in shape.items()},
            **{k: str(v) for k, v in extra.items()}}


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _start_measuring() -> int:
    """Reset the process's peak RSS to its current RSS (Linux: ``/proc/self/clear_refs`` "5", which getrusage's
    ``ru_maxrss`` follows) and return it: what the process holds before the measured work. Elsewhere the peak so
    far (a looser start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return _peak_rss()
    return _peak_rss()


class RandomState:
    """Our model state with random values, made one tensor at a time when asked for (nothing is kept)."""

    def __init__(self, model_cfg):
        import torch

        from shardwise.model import Transformer

        with torch.device("meta"):
            self.shapes = {k: tuple(v.shape) for k, v in Transformer(model_cfg).state_dict().items()}

    def __getitem__(self, key):
        import zlib

        import torch

        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        return torch.randn(self.shapes[key], generator=g) * 0.02

    def __contains__(self, key):
        return key in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def write_hf_directory(shape: dict, out: str) -> None:
    """A transformers Llama directory with random weights (streamed: one tensor at a time)."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.data.tokenizer import ByteTokenizer
    from shardwise.hf.export import export_state

    m = resolve(Config.load(overrides=_overrides(shape))).model
    export_state(RandomState(m), m, ByteTokenizer(), Path(out), "fp32", "1GB")


def write_run(shape: dict, run_dir: str) -> None:
    """A run directory (config.toml, one layout-free checkpoint) of a model with random weights, one file per
    block so that no writer holds the model."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.train.checkpoint import begin_checkpoint, finish_checkpoint, write_tensor_file

    cfg = resolve(Config.load(overrides=_overrides(shape, **{"run.dir": run_dir})))
    run = Path(run_dir)
    run.mkdir(parents=True)
    (run / "config.toml").write_text(cfg.to_toml())
    state = RandomState(cfg.model)
    groups: dict[str, list[str]] = {}
    for key in state:
        groups.setdefault(key.split(".")[1] if key.startswith("blocks.") else key, []).append(key)
    tmp = begin_checkpoint(run / "checkpoints", 1)
    files, shards = {}, {}
    for i, keys in enumerate(groups.values()):
        entries = {f"model/{k}@0": state[k].reshape(-1) for k in keys}
        (name,) = (f := write_tensor_file(tmp, f"shard-{i:05d}", entries))
        files.update(f)
        for k in keys:
            n = entries[f"model/{k}@0"].numel()
            shards[f"model/{k}"] = {"shape": list(state.shapes[k]), "dtype": "float32",
                                    "pieces": [[name, f"model/{k}@0", 0, n]]}
        del entries
    meta = {"step": 1, "optimizer": {"param_groups": []}, "config": cfg.to_dict(), "shards": shards}
    finish_checkpoint(run / "checkpoints", 1, tmp, files, meta, keep=1)


def write_inputs(tmp: str, export_shape: dict | None, import_shape: dict | None) -> None:
    """Every input of the measurements, in one child process: the runs to export, the directories to import
    (each with its tiny warm-up twin)."""
    if export_shape is not None:
        write_run(export_shape, f"{tmp}/run")
        write_run(WARM_UP, f"{tmp}/warm-run")
    if import_shape is not None:
        write_hf_directory(import_shape, f"{tmp}/hf")
        write_hf_directory(WARM_UP, f"{tmp}/warm-hf")


def measure_export(run_dir: str, out: str, shard_bytes: int, warm_up: str, queue) -> None:
    """In a fresh process: the export's peak RSS, and the process's own before it (after exporting the tiny
    run ``warm_up``: the fixed part)."""
    import shardwise.hf.export as export

    export.export_run(Path(warm_up), Path(f"{warm_up}-out"), max_shard_size=shard_bytes)
    before = _start_measuring()
    export.export_run(Path(run_dir), Path(out), max_shard_size=shard_bytes)
    queue.put({"peak_rss": _peak_rss(), "before_export_rss": before,
               "files": sorted(p.name for p in Path(out).glob("model*.safetensors"))})


def measure_import_rank(rank: int, world: int, port: int, hf_dir: str, layout: dict, run_dir: str, warm_up: str,
                        queue) -> None:
    """One rank of a fresh 4-rank group: peak RSS before the model (after starting from the tiny ``warm_up``
    directory the same way: the fixed part), after building the engine, after reading the weights; the engine's
    model-state bytes; the largest tensor."""
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.dist.mesh import ParallelDims
    from shardwise.hf.init import init_from_pretrained
    from shardwise.model import Transformer
    from shardwise.train.engine import Engine

    def start(directory: str):
        over = {**_overrides({}, **layout), "parallel.nproc": str(world), "model.init_from": f"hf:{directory}",
                "parallel.backend": "gloo"}
        over = {k: v for k, v in over.items() if not k.startswith("model.") or k in ("model.init_from", "model.preset")}
        cfg = resolve(Config.load(overrides=over), world_size=world)
        engine = Engine(cfg, ParallelDims.from_config(cfg.parallel, world).build("cpu"), torch.device("cpu"),
                        Path(run_dir))
        return cfg, engine

    cfg, engine = start(warm_up)
    init_from_pretrained(engine, cfg)
    del cfg, engine
    gc.collect()
    dist.barrier()
    before = _start_measuring()
    cfg, engine = start(hf_dir)
    built = _peak_rss()
    init_from_pretrained(engine, cfg)
    after = _peak_rss()
    share = engine.memory_bytes()
    with torch.device("meta"):
        full = Transformer(cfg.model).state_dict()
    largest = max(t.numel() * 4 for t in full.values())
    model_bytes = sum(t.numel() * 4 for t in {id(t): t for t in full.values()}.values())
    queue.put({"rank": rank, "before_rss": before, "built_peak_rss": built, "peak_rss": after,
               "share_bytes": int(share["params"] + share.get("grads", 0) + share.get("master", 0)),
               "params_bytes": int(share["params"]), "largest_tensor_bytes": largest, "model_bytes": model_bytes})
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(ctx, target, *args) -> None:
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join()
    if p.exitcode:
        raise RuntimeError(f"{target.__name__} failed (exit code {p.exitcode})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models (for the test suite)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--dir", type=Path, help="where to write the models (default: a temporary directory)")
    parser.add_argument("--only", choices=["export", "import"], help="measure one side only")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    add_machine_note(parser)
    args = parser.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    import_shape, export_shape, shard = SIZES["quick" if args.quick else "full"]
    ctx = mp.get_context("spawn")
    report: dict = {"host": platform.node(), "quick": args.quick}
    report["export"], report["import"] = {"ok": True}, {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        _child(ctx, write_inputs, tmp, export_shape if args.only != "import" else None,
               import_shape if args.only != "export" else None)
        if args.only != "import":
            report["export"] = measure_export_side(ctx, tmp, export_shape, shard, args.quick)
        if args.only != "export":
            report["import"] = measure_import_side(ctx, tmp, import_shape, args.layouts)
    report["ok"] = report["export"]["ok"] and all(r["ok"] for rows in report["import"].values() for r in rows)
    bench_run.write(args.json, report)
    print(f"all within bounds: {report['ok']}")
    return 0 if report["ok"] else 1


def measure_export_side(ctx, tmp: str, export_shape: dict, shard: int, quick: bool) -> dict:
    """A run >= 8 shards big, exported in a fresh process (after a tiny run's export in the same process)."""
    queue = ctx.Queue()
    _child(ctx, measure_export, f"{tmp}/run", f"{tmp}/out", shard, f"{tmp}/warm-run", queue)
    got = queue.get()
    model = sum(p.stat().st_size for p in Path(f"{tmp}/run/checkpoints").glob("step_*/shard-*.safetensors"))
    grew = got["peak_rss"] - got["before_export_rss"]
    # at the quick sizes the interpreter itself (torch) is many shards big: there only the growth is bounded
    bounded = grew if quick else got["peak_rss"]
    report = {**got, "shard_bytes": shard, "model_bytes": model, "model_over_shard": model / shard,
              "peak_over_shard": got["peak_rss"] / shard, "growth_over_shard": grew / shard,
              "ok": model >= 8 * shard and bounded < 2 * shard}
    print(f"export: model {model / MB:,.0f} MB = {model / shard:.1f} shards of {shard / MB:,.0f} MB; peak RSS "
          f"{got['peak_rss'] / MB:,.0f} MB = {got['peak_rss'] / shard:.2f} x the shard size (the process before "
          f"the export {got['before_export_rss'] / MB:,.0f} MB; grown by {grew / MB:,.1f} MB = "
          f"{grew / shard:.2f} shards); {len(got['files'])} files")
    return report


def measure_import_side(ctx, tmp: str, import_shape: dict, layouts: list[str]) -> dict:
    """The same directory started on 4 fresh ranks per layout."""
    report: dict = {}
    for name in layouts:
        layout = LAYOUTS[name]
        queue, port = ctx.Queue(), _free_port()
        ranks = [ctx.Process(target=measure_import_rank,
                             args=(r, 4, port, f"{tmp}/hf", layout, f"{tmp}/r", f"{tmp}/warm-hf", queue))
                 for r in range(4)]
        for p in ranks:
            p.start()
        rows = sorted((queue.get(timeout=600) for _ in ranks), key=lambda r: r["rank"])
        for p in ranks:
            p.join()
        for r in rows:
            r["bound_bytes"] = r["before_rss"] + r["share_bytes"] + r["largest_tensor_bytes"]
            r["over_bound_bytes"] = r["peak_rss"] - r["bound_bytes"]
            r["within_bound"] = r["peak_rss"] <= r["bound_bytes"]
            # the allocator keeps some freed memory (glibc's heap under its dynamic mmap threshold) and a rank's
            # threads and objects vary by some MB: 25 % of share + largest tensor (at least 32 MB) is allowed --
            # still below what reading a whole unit, stage or model takes
            allowance = max((r["share_bytes"] + r["largest_tensor_bytes"]) // 4, 32 * MB)
            r["ok"] = r["peak_rss"] <= r["bound_bytes"] + allowance and r["model_bytes"] >= 3 * r["params_bytes"]
        report[name] = rows
        for r in rows:
            print(f"import {name} rank {r['rank']}: peak RSS {r['peak_rss'] / MB:,.0f} MB; before "
                  f"{r['before_rss'] / MB:,.0f} + share {r['share_bytes'] / MB:,.0f} + largest tensor "
                  f"{r['largest_tensor_bytes'] / MB:,.0f} = {r['bound_bytes'] / MB:,.0f} MB "
                  f"({r['over_bound_bytes'] / MB:+,.0f} MB); model {r['model_bytes'] / MB:,.0f} MB")
    return report


if __name__ == "__main__":
    sys.exit(main())
