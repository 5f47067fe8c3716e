"""Benchmark: gradient compression in data-parallel training -- bytes sent and step time per method.

Every method (none, fp16, bf16, int8, topk) trains its own replica of one small GPT inside the
*same* worker processes, through our DataParallel with ``GradientAllReduce(algorithm, method)``
as its all-reduce (what ``comm.compression`` selects in the trainer). The timed steps alternate
between the methods, the one going first rotating every step, so drift on a shared machine hits
all alike. Reported per method: the bytes this rank actually put on the wire per step (counted at
every point-to-point send of our algorithms; with the backend's own collectives, whose wire traffic
is not visible, the bytes handed to them -- see ``shardwise.dist.comm.counting``), the median step
time (forward + backward + AdamW, slowest rank), both as ratios to uncompressed ("none"), and the
mean loss of the last steps (compression must not stop the model from learning; top-k and int8
carry what they drop by error feedback).

    python bench/bench_compress.py --nproc 2 --steps 12
    python bench/bench_compress.py --algorithm ring --json bench/results/compress_ring.json

gloo on CPU. Writes bench/results/compress.json by default.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp import build_model  # noqa: E402 - the same small GPT as the data-parallel benchmark

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402
from shardwise.dist import free_port, shutdown_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "compress.json"
METHODS = ("none", "fp16", "bf16", "int8", "topk")


def _batch(args, rank: int, step: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, 257, (args.batch, args.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from shardwise.dist import init_distributed
    from shardwise.dist.comm.compress import GradientAllReduce
    from shardwise.parallel import DataParallel

    init_distributed("gloo", timeout_s=600)
    base, desc = build_model(args)
    nets, opts, fns = {}, {}, {}
    for method in args.methods:
        model = copy.deepcopy(base)
        fns[method] = GradientAllReduce(args.algorithm, method, topk_ratio=args.topk_ratio)
        nets[method] = DataParallel(model, bucket_mb=args.bucket_mb, all_reduce_fn=fns[method])
        opts[method] = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    del base
    times = {m: [] for m in args.methods}
    sent = {m: [] for m in args.methods}
    losses = {m: [] for m in args.methods}
    methods = list(args.methods)
    for step in range(args.warmup + args.steps):
        order = methods[step % len(methods):] + methods[:step % len(methods)]
        for m in order:
            x, y = _batch(args, rank, step)
            dist.barrier()
            fns[m].pop_stats()
            t0 = time.perf_counter()
            opts[m].zero_grad(set_to_none=True)
            loss = nets[m](x, y)
            loss.backward()
            opts[m].step()
            out = torch.tensor([time.perf_counter() - t0, loss.item(), _moved(fns[m].pop_stats())], dtype=torch.float64)
            dist.all_reduce(out[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(out[1:2])
            if step >= args.warmup:
                times[m].append(out[0].item())
                sent[m].append(out[2].item())
            losses[m].append(out[1].item() / args.nproc)
    if rank == 0:
        queue.put({"model": desc, "times": times, "sent": sent, "losses": losses})
    shutdown_distributed()


def _moved(stats) -> float:
    """Bytes on the wire when our algorithms sent them (counted per send); with the backend's own
    collectives, whose wire traffic is not visible, the bytes handed to them."""
    return float(stats.bytes_sent if stats.backend_handed == 0 else stats.handed)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--algorithm", default="native", help="all-reduce algorithm under the compression")
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=12, help="timed steps of each method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--json", default=str(RESULTS))
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    if "none" not in args.methods:
        args.methods = ["none", *args.methods]

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, free_port(), queue), nprocs=args.nproc, start_method="spawn")
    run = queue.get()
    ref_t = statistics.median(run["times"]["none"])
    ref_b = statistics.median(run["sent"]["none"])
    tail = max(1, args.steps // 4)
    ref_loss = statistics.fmean(run["losses"]["none"][-tail:])
    methods = {}
    for m in args.methods:
        t, b = statistics.median(run["times"][m]), statistics.median(run["sent"][m])
        final = statistics.fmean(run["losses"][m][-tail:])
        methods[m] = {"bytes_sent_per_step": b, "bytes_ratio": b / ref_b, "step_s_median": t,
                      "step_time_ratio": t / ref_t, "final_loss": final, "final_loss_minus_none": final - ref_loss,
                      "step_s": run["times"][m],
                      "losses": run["losses"][m]}
    result = {
        "benchmark": "gradient compression in data-parallel training (bytes sent and step time vs uncompressed)",
        "torch": torch.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "backend": "gloo", "nproc": args.nproc, "algorithm": args.algorithm, "topk_ratio": args.topk_ratio,
        "batch_per_rank": args.batch, "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps,
        "model": run["model"], "methods": methods,
    }
    bench_run.write(args.json, result)
    print(f"{args.nproc} ranks, {run['model']['parameters'] / 1e6:.1f}M parameters, algorithm {args.algorithm}")
    print("| method | bytes sent / step | x none | step (ms) | x none | final loss (- none) |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, r in methods.items():
        print(f"| {m} | {r['bytes_sent_per_step']:,.0f} | {r['bytes_ratio']:.3f} | {r['step_s_median'] * 1e3:.0f} | "
              f"{r['step_time_ratio']:.2f} | {r['final_loss']:.3f} ({r['final_loss_minus_none']:+.3f}) |")
    return result


if __name__ == "__main__":
    main()
