"""Where a pipeline step's time goes, ours against torch.distributed.pipelining, per rank.

bench_pipeline.py's model, split, batch and step (forward + backward of every micro-batch), both engines in the
same gloo ranks, the order alternating every step. Per rank and engine, medians over the timed steps of:
the step (``step``), forward and backward computation (``F``, ``B``), posting transfers (``post``: ours from its
timeline's send/receive events, torch's ``_batch_p2p``), blocking on transfers (``wait``: ours waits for a
receive, for its sends at the end and the tied embedding's gradient exchange; torch's ``_wait_batch_p2p``) and
the rest (``other``: the executors' own Python, the loss bookkeeping). Torch's side is timed by wrapping its
stage's ``forward_one_chunk`` / ``backward_one_chunk`` and the schedule module's two transfer helpers in this
process (about a microsecond per call).

    python bench/profile_pipeline.py --nproc 2 --schedule 1f1b --steps 10
    python bench/profile_pipeline.py --nproc 2 --schedule interleaved --json bench/results/pipeline_profile.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline  # noqa: E402

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402
from shardwise.dist import free_port, shutdown_distributed  # noqa: E402

PARTS = ("step", "F", "B", "post", "wait", "other")


def _timing(spent: dict, obj, name: str, part: str) -> None:
    """Wrap ``obj.name`` so that its wall time adds to ``spent[part]``."""
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[part] = spent.get(part, 0.0) + time.perf_counter() - t0

    setattr(obj, name, timed)


def _worker(rank: int, nproc: int, args, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed import pipelining as tpp
    from torch.distributed.pipelining import schedules as torch_schedules

    from shardwise.dist import init_distributed
    from shardwise.parallel.pipeline import Pipeline, build_stage
    from shardwise.parallel.pipeline.partition import partition

    init_distributed("gloo", timeout_s=600)
    cfg = bench_pipeline._cfg(args)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    v = 2 if args.schedule == "interleaved" else 1
    n_stages, m = nproc * v, args.microbatches
    split = partition(cfg, n_stages, "even")
    stage_ids = [c * nproc + rank for c in range(v)]
    ours = Pipeline([build_stage(cfg, s, n_stages, split[s], seed=1) for s in stage_ids], list(range(nproc)),
                    args.schedule, m, d_model=cfg.d_model)
    peer_modules = [bench_pipeline._Logits(build_stage(cfg, s, n_stages, split[s], seed=1)) for s in stage_ids]
    peer_stages = [tpp.PipelineStage(mod, s, n_stages, torch.device("cpu"))
                   for mod, s in zip(peer_modules, stage_ids, strict=True)]
    peer = getattr(tpp, bench_pipeline.TORCH_SCHEDULES[args.schedule])(
        peer_stages if v > 1 else peer_stages[0], m, loss_fn=bench_pipeline._loss)
    spent: dict[str, float] = {}
    for stage in peer_stages:
        _timing(spent, stage, "forward_one_chunk", "F")
        _timing(spent, stage, "backward_one_chunk", "B")
    _timing(spent, torch_schedules, "_batch_p2p", "post")
    _timing(spent, torch_schedules, "_wait_batch_p2p", "wait")

    def run_peer():
        if rank == 0:
            peer.step(tokens, target=targets if rank == nproc - 1 else None, losses=[])
        elif rank == nproc - 1:
            peer.step(target=targets, losses=[])
        else:
            peer.step()

    rows: dict[str, list[dict]] = {"ours": [], "torch": []}
    for step in range(args.warmup + args.steps):
        for name in ("ours", "torch") if step % 2 == 0 else ("torch", "ours"):
            for mod in [*ours.chunks, *peer_modules]:
                mod.zero_grad(set_to_none=True)
            spent.clear()
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ours":
                ours.step(tokens, targets)
            else:
                run_peer()
            row = {"step": time.perf_counter() - t0}
            if name == "ours":
                posts = set()  # the sends and receives of one batch share one interval
                for e in ours.timeline.events:
                    if e.kind in ("send", "recv"):
                        posts.add((e.start, e.end))
                    else:
                        row[e.kind] = row.get(e.kind, 0.0) + e.end - e.start
                row["post"] = sum(end - start for start, end in posts)
            else:
                row.update(spent)
            row["other"] = row["step"] - sum(row.get(k, 0.0) for k in PARTS[1:5])
            if step >= args.warmup:
                rows[name].append(row)
    medians = {name: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in PARTS} for name, rs in rows.items()}
    out: list = [None] * nproc
    dist.all_gather_object(out, medians)
    if rank == 0:
        queue.put(out)
    shutdown_distributed()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--schedule", default="1f1b", choices=list(bench_pipeline.TORCH_SCHEDULES))
    p.add_argument("--preset", default="cpu-demo")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.nproc, args, free_port(), queue), nprocs=args.nproc, start_method="spawn")
    per_rank = queue.get()
    print(f"{args.schedule}, p={args.nproc}, m={args.microbatches}: median ms per step")
    print(f"{'rank':>4} {'engine':>6} " + " ".join(f"{k:>7}" for k in PARTS))
    for rank, medians in enumerate(per_rank):
        for name, row in medians.items():
            print(f"{rank:>4} {name:>6} " + " ".join(f"{row[k] * 1e3:7.1f}" for k in PARTS))
    report = {"schedule": args.schedule, "nproc": args.nproc, "microbatches": args.microbatches,
              "median_s_per_rank": per_rank}
    if args.json:
        bench_run.write(args.json, report)
    return report


if __name__ == "__main__":
    main()
