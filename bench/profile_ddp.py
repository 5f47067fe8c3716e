"""Where a data-parallel step's time goes: our DataParallel (torch DDP's bucket cut, and the small-last-bucket
cut) against torch's DistributedDataParallel, measured inside the running processes.

bench_ddp.py's model, batch and step, three replicas in the same 2 gloo ranks, the order rotating every step.
Per variant, medians over the timed steps (each the slowest rank's): the step, forward, backward and optimizer
wall seconds, the process's CPU seconds (every thread, gloo's included) and the main thread's; for ours also
the main thread's CPU inside the gradient hooks, inside copying gradients into buckets (``_stage``) and inside
launching all-reduces (``_launch``), timed by wrapping those methods on this process's class; and the medians
of the per-step ratios to torch of the step time and the process CPU time.

    python bench/profile_ddp.py --steps 33        # prints a table; --json PATH to keep it

Timing wrappers add about a microsecond per call; torch's reducer (C++) cannot be split the same way, so its
hook time is in its backward.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ddp  # noqa: E402

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402
from shardwise.dist import free_port, shutdown_distributed  # noqa: E402

VARIANTS = {"ours": None, "ours_last_1mb": 1.0, "torch": None}
"""Variant -> DataParallel's ``last_bucket_mb`` (torch: its own DDP)."""
INSIDE = ("_on_grad_ready", "_stage", "_launch")


def _clock_methods(cls, totals: dict) -> None:
    """Wrap ``cls``'s methods in :data:`INSIDE` to add their main-thread CPU seconds to ``totals``."""
    for name in INSIDE:
        original = getattr(cls, name)

        def timed(self, *a, _original=original, _name=name):
            t0 = time.thread_time()
            try:
                return _original(self, *a)
            finally:
                totals[_name] += time.thread_time() - t0

        setattr(cls, name, timed)


def _step(net, opt, args, rank: int, step: int) -> list[float]:
    x, y = bench_ddp._batch(args, rank, step)
    dist.barrier()
    c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = net(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    out = torch.tensor([t3 - t0, t1 - t0, t2 - t1, t3 - t2, time.process_time() - c0, time.thread_time() - m0],
                       dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


COLUMNS = ("step", "forward", "backward", "optimizer", "process_cpu", "main_thread_cpu")


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from shardwise.config import CommConfig
    from shardwise.dist import init_distributed
    from shardwise.dist.comm.compress import gradient_all_reduce
    from shardwise.parallel import DataParallel

    init_distributed("gloo", timeout_s=600)
    totals = dict.fromkeys(INSIDE, 0.0)
    _clock_methods(DataParallel, totals)
    base, _ = bench_ddp.build_model(args)
    nets, opts = {}, {}
    for kind, last in VARIANTS.items():
        model = copy.deepcopy(base)
        nets[kind] = (torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb) if kind == "torch"
                      else DataParallel(model, bucket_mb=args.bucket_mb, last_bucket_mb=last,
                                        all_reduce_fn=gradient_all_reduce(CommConfig())))
        opts[kind] = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    kinds = list(VARIANTS)
    rows = {k: [] for k in kinds}
    for step in range(args.warmup + args.steps):
        for kind in kinds[step % len(kinds):] + kinds[:step % len(kinds)]:
            for name in INSIDE:
                totals[name] = 0.0
            row = _step(nets[kind], opts[kind], args, rank, step)
            if step >= args.warmup:
                rows[kind].append(row + [totals[n] for n in INSIDE])
    if rank == 0:
        queue.put({"rows": rows, "buckets": {k: getattr(nets[k], "bucket_sizes", None) for k in kinds}})
    shutdown_distributed()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=33)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--json", type=Path, default=None)
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, free_port(), queue), nprocs=args.nproc, start_method="spawn")
    got = queue.get()
    names = [*COLUMNS, *(f"cpu_in{n}" for n in INSIDE)]
    result = {"load_average": os.getloadavg(), "buckets": got["buckets"], "median_s": {}, "ratio_to_torch": {}}
    for kind, rows in got["rows"].items():
        result["median_s"][kind] = {n: statistics.median(r[i] for r in rows) for i, n in enumerate(names)}
        torch_rows = got["rows"]["torch"]
        result["ratio_to_torch"][kind] = {
            n: statistics.median(a[i] / b[i] for a, b in zip(rows, torch_rows, strict=True))
            for i, n in ((0, "step"), (4, "process_cpu"))}
    for kind, med in result["median_s"].items():
        inside = "" if kind == "torch" else ", ".join(f"{n[6:]} {med[n] * 1e3:.1f} ms" for n in names[6:])
        line = f"{kind:14} " + ", ".join(f"{n} {med[n]:.4f}" for n in COLUMNS)
        ratio = result["ratio_to_torch"][kind]
        print(line + (f"; inside: {inside}" if inside else "")
              + f"; / torch: step {ratio['step']:.3f}, cpu {ratio['process_cpu']:.3f}")
    if args.json:
        bench_run.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
