"""Benchmark: communication overlapped with computation (issue 34), side by side in one run.

* ZeRO-1 and ZeRO-2 against plain data parallelism (our ``DataParallel``) on the same layout -- all ranks
  data-parallel, the same model, data and AdamW -- with the overlaps on (``parallel.zero_overlap_param_gather``,
  ``parallel.zero_overlap_grad_reduce``: the defaults) and off ("wait"): step time ratio ZeRO / DP (target <= 1)
  and the exposed data-parallel time per step, before (off) and after (on);
* tensor parallelism with sequence parallelism over all ranks, decomposed (``parallel.tp_comm_overlap``) or not:
  step time ratio and the exposed tensor-parallel time per step.

Exposed time is what each rank's compute thread waited for the axis's communication, from the clocks of the
running job (``CommStats.waited_s``, :mod:`shardwise.dist.comm.counting`), the largest over the ranks. Variants
of a group run in the same processes, interleaved step by step with rotating order (as bench_zero.py), so drift
on the machine hits all alike. gloo on CPU, fp32.

    python bench/bench_overlap.py                                 # 2 and 4 ranks -> bench/results/overlap.json
    python bench/bench_overlap.py --worlds 2 --steps 3 --d-model 64 --n-layers 2 --seq-len 32   # a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.dist import free_port, shutdown_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zero import build_model  # noqa: E402 - the same model as the ZeRO benchmark's

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "overlap.json"
DATA_PARALLEL = ("dp", "zero1", "zero1_wait", "zero2", "zero2_wait")
TENSOR_PARALLEL = ("tp", "tp_overlap")


def _wrap(variant: str, args, group):
    """(callable model, optimizer, the CommStats its waits are timed in) for one variant."""
    from shardwise.dist.comm.counting import CommStats
    from shardwise.parallel.data import DataParallel
    from shardwise.parallel.tensor.plan import apply_tensor_parallel
    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer

    model, stats = build_model(args), CommStats()
    adamw = {"lr": 1e-4, "weight_decay": 0.1}
    if variant == "dp":
        net = DataParallel(model, bucket_mb=args.bucket_mb, comm_stats=stats)
        return net, torch.optim.AdamW(model.parameters(), **adamw), stats
    if variant.startswith("zero"):
        overlap = not variant.endswith("_wait")
        net = ZeroDataParallel(model, stage=int(variant[4]), bucket_mb=args.bucket_mb, comm_stats=stats,
                               overlap_reduce=overlap, overlap_param_gather=overlap)
        return net, ZeroOptimizer(net, torch.optim.AdamW(model.parameters(), **adamw)), stats
    apply_tensor_parallel(model, group, stats, sequence_parallel=True, overlap=variant == "tp_overlap")
    return model, torch.optim.AdamW(model.parameters(), **adamw), stats


def _worker(rank: int, world: int, port: int, variants: list[str], args, queue) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    nets = {v: _wrap(v, args, group) for v in variants}
    tp = variants[0] in TENSOR_PARALLEL
    g = torch.Generator().manual_seed(1000 + (0 if tp else rank))  # tensor-parallel ranks read the same batch
    out = {v: {"step_s": [], "exposed_s": []} for v in variants}
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, 257, (args.batch, args.seq_len), generator=g)
        order = variants[step % len(variants):] + variants[:step % len(variants)]
        for v in order:
            net, opt, stats = nets[v]
            dist.barrier()
            stats.pop()
            t0 = time.perf_counter()
            net(x, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            m = torch.tensor([time.perf_counter() - t0, stats.pop().waited_s])
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                out[v]["step_s"].append(float(m[0]))
                out[v]["exposed_s"].append(float(m[1]))
    if rank == 0:
        queue.put(out)
    shutdown_distributed()


def _launch(variants, world: int, args):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, free_port(), variants, args, queue), nprocs=world, start_method="spawn")
    return queue.get()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="numbers of ranks")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank (tensor parallel: per group) per step")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--json", default=str(RESULTS))
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    out = {"benchmark": "overlap: ZeRO-1/2 vs data parallelism, decomposed tensor parallelism, exposed time",
           "torch": torch.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "backend": "gloo", "precision": "fp32", "args": vars(args), "worlds": {}}
    print(f"{'ranks':<6}{'variant':<12}{'step (median)':>14}{'exposed (median)':>18}{'ratio':>8}")
    for world in args.worlds:
        runs = {**_launch(list(DATA_PARALLEL), world, args), **_launch(list(TENSOR_PARALLEL), world, args)}
        for r in runs.values():
            r["step_s_median"] = statistics.median(r["step_s"])
            r["exposed_s_median"] = statistics.median(r["exposed_s"])
        ratios = {}
        for ours, base in (("zero1", "dp"), ("zero2", "dp"), ("zero1_wait", "dp"), ("zero2_wait", "dp"),
                           ("tp_overlap", "tp")):
            ratios[f"{ours}/{base}"] = {
                "step_time": runs[ours]["step_s_median"] / runs[base]["step_s_median"],
                "step_time_per_step_median": statistics.median(
                    a / b for a, b in zip(runs[ours]["step_s"], runs[base]["step_s"], strict=True))}
        out["worlds"][str(world)] = {"runs": runs, "ratios": ratios}
        for v, r in runs.items():
            base = "tp" if v.startswith("tp") else "dp"
            ratio = ratios.get(f"{v}/{base}", {}).get("step_time", 1.0)
            print(f"{world:<6}{v:<12}{r['step_s_median']:>13.4f}s{r['exposed_s_median']:>17.4f}s{ratio:>8.3f}",
                  flush=True)
    bench_run.write(args.json, out)
    return out


if __name__ == "__main__":
    main()
