"""Benchmark: our DataParallel against torch's DistributedDataParallel, side by side.

Both wrap identical replicas of one model in the *same* worker processes. After a
warm-up, the timed steps alternate between them (with ``--baseline`` also a third
replica trained without any gradient synchronisation, to show what communication
costs), the one going first rotating every step, so drift on a shared machine hits
all alike. The report is the median step time (forward + backward + AdamW step, the
slowest rank) of each, the ratio of the medians ours/torch, and the median of the
per-step ratios (each step of ours against the adjacent step of torch).
The losses of the two runs are compared step by step as a check that both trained the
same model. Peak memory (max RSS) is measured in separate short runs, one variant per
set of processes, because the RSS high-water mark of a process cannot be split.

    python bench/bench_ddp.py --nproc 2 --steps 20 --bucket-mb 25
    python bench/bench_ddp.py --json bench/results/ddp.json   # the default output

gloo on CPU; with CUDA and nccl (``--backend nccl``) the same code runs on GPUs.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shardwise.bench_result import BenchRun, add_machine_note
from shardwise.dist import free_port, shutdown_distributed

RESULTS = Path(__file__).resolve().parent / "results" / "ddp.json"


def build_model(args) -> tuple[nn.Module, dict]:
    """shardwise's Transformer (cpu-demo shape, widened), or a stand-in when it is not available."""
    try:
        from shardwise.config import Config
        from shardwise.config_resolve import resolve
        from shardwise.model import Transformer

        overrides = {"model.preset": "cpu-demo", "model.d_model": str(args.d_model),
                     "model.n_layers": str(args.n_layers), "model.max_seq_len": str(args.seq_len),
                     "data.seq_len": str(args.seq_len)}
        cfg = resolve(Config.load(overrides=overrides), world_size=args.nproc, tokenizer_vocab=257).model
        model = Transformer(cfg)
        desc = {"name": "shardwise.model.Transformer", "preset": "cpu-demo", "flavor": cfg.flavor,
                "d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab_size": cfg.vocab_size}
    except ImportError:
        model = _StandIn(args.d_model, args.n_layers)
        desc = {"name": "stand-in MLP LM", "d_model": args.d_model, "n_layers": args.n_layers, "vocab_size": 257}
    desc["parameters"] = sum(p.numel() for p in model.parameters())
    return model, desc


class _StandIn(nn.Module):
    def __init__(self, d: int, n_layers: int, vocab: int = 257):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n_layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _batch(args, rank: int, step: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, 257, (args.batch, args.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _wrap(kind: str, model: nn.Module, args):
    from shardwise.config import CommConfig
    from shardwise.dist.comm.compress import gradient_all_reduce
    from shardwise.parallel import DataParallel

    if kind == "ours":  # exactly as the trainer wraps it (train/engine.py): the configured all-reduce
        return DataParallel(model, bucket_mb=args.bucket_mb, all_reduce_fn=gradient_all_reduce(CommConfig()))
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    return model  # "plain": no gradient synchronisation (memory baseline)


def _step(net, opt, args, rank: int, step: int) -> tuple[list[float], float]:
    """One timed optimizer step; returns ([step, forward, backward, optimizer, process CPU] seconds, each the
    slowest rank's, and the mean loss). The CPU time is the process's, every thread (gloo's included)."""
    x, y = _batch(args, rank, step)
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = net(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    c1 = time.process_time()
    elapsed = torch.tensor([t3 - t0, t1 - t0, t2 - t1, t3 - t2, c1 - c0, loss.item()], dtype=torch.float64)
    dist.all_reduce(elapsed[:-1], op=dist.ReduceOp.MAX)
    dist.all_reduce(elapsed[-1:])
    return elapsed[:-1].tolist(), elapsed[-1].item() / dist.get_world_size()


PHASES = ("step", "forward", "backward", "optimizer", "cpu")
"""What :func:`_step` times, in its order."""


def _worker(rank: int, args, port: int, mode: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from shardwise.dist import init_distributed

    init_distributed(args.backend, timeout_s=600)
    base, desc = build_model(args)
    kinds = ([k for k in ("ours", "torch", "plain") if k != "plain" or args.baseline] if mode == "time"
             else [mode])
    nets, opts = {}, {}
    for kind in kinds:
        model = copy.deepcopy(base)
        nets[kind] = _wrap(kind, model, args)
        opts[kind] = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    del base
    times = {k: [] for k in kinds}
    phases = {k: {ph: [] for ph in PHASES[1:]} for k in kinds}
    losses = {k: [] for k in kinds}
    steps = args.warmup + (args.steps if mode == "time" else args.memory_steps)
    for step in range(steps):
        order = kinds[step % len(kinds):] + kinds[:step % len(kinds)]  # rotate who goes first
        for kind in order:
            seconds, loss = _step(nets[kind], opts[kind], args, rank, step)
            losses[kind].append(loss)
            if step >= args.warmup:
                times[kind].append(seconds[0])
                for ph, value in zip(PHASES[1:], seconds[1:], strict=True):
                    phases[kind][ph].append(value)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)  # ru_maxrss is in KiB on Linux
    extra = {}
    if "ours" in nets:
        extra = {"buckets": len(nets["ours"].bucket_sizes), "comm_bytes_per_step": nets["ours"].comm_bytes_last_step,
                 "overlapped_buckets": nets["ours"].overlapped_buckets_last_step}
    if rank == 0:
        queue.put({"model": desc, "times": times, "phases": phases, "losses": losses, "peak_rss_mb": rss.item(),
                   **extra})
    shutdown_distributed()


def _launch(args, mode: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, free_port(), mode, queue), nprocs=args.nproc, start_method="spawn")
    return queue.get()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="worker processes (ranks)")
    p.add_argument("--steps", type=int, default=30, help="timed steps of each variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant first")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of both wrappers (MiB)")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="intra-op threads per rank")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "auto"))
    p.add_argument("--baseline", action="store_true",
                   help="also time a third replica trained without gradient synchronisation")
    p.add_argument("--memory-steps", type=int, default=3, help="steps of each single-variant memory run (0: skip)")
    p.add_argument("--json", default=str(RESULTS), help="where to write the results")
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    if args.threads * args.nproc > (os.cpu_count() or 1):
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc)

    run = _launch(args, "time")
    times = run["times"]
    ours, ref = statistics.median(times["ours"]), statistics.median(times["torch"])
    paired = statistics.median(a / b for a, b in zip(times["ours"], times["torch"], strict=True))
    loss_gap = max(abs(a - b) for a, b in zip(run["losses"]["ours"], run["losses"]["torch"], strict=True))
    result = {
        "benchmark": "data parallel: shardwise DataParallel vs torch DistributedDataParallel",
        "torch": torch.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "backend": args.backend, "nproc": args.nproc, "threads_per_rank": args.threads,
        "bucket_mb": args.bucket_mb, "batch_per_rank": args.batch, "seq_len": args.seq_len,
        "warmup": args.warmup, "steps": args.steps, "model": run["model"],
        "ours": {"step_s_median": ours, "step_s": run["times"]["ours"], "buckets": run["buckets"],
                 "comm_bytes_per_step": run["comm_bytes_per_step"], "overlapped_buckets": run["overlapped_buckets"]},
        "torch_ddp": {"step_s_median": ref, "step_s": run["times"]["torch"]},
        "ratio_step_time": ours / ref,
        "ratio_step_time_paired_median": paired,
        "max_loss_difference": loss_gap,
        "peak_rss_mb_both_in_one_process": run["peak_rss_mb"],
    }
    if "plain" in times:
        result["plain"] = {"step_s_median": statistics.median(times["plain"]), "step_s": times["plain"]}
    for kind, key in (("ours", "ours"), ("torch", "torch_ddp"), ("plain", "plain")):
        if kind in run["phases"]:  # where the time goes: medians per phase, and the process's CPU time
            result[key]["phase_s_median"] = {ph: statistics.median(v) for ph, v in run["phases"][kind].items()}
    result["ratio_cpu_time_paired_median"] = statistics.median(
        a / b for a, b in zip(run["phases"]["ours"]["cpu"], run["phases"]["torch"]["cpu"], strict=True))
    if args.memory_steps:
        for kind, key in (("plain", "plain"), ("ours", "ours"), ("torch", "torch_ddp")):
            mem = _launch(args, kind)["peak_rss_mb"]
            result.setdefault(key, {})["peak_rss_mb"] = mem
        result["ratio_peak_rss"] = result["ours"]["peak_rss_mb"] / result["torch_ddp"]["peak_rss_mb"]

    out = Path(args.json)
    bench_run.write(out, result)
    _print_table(result, out)
    return result


def _print_table(r: dict, out: Path) -> None:
    m = r["model"]
    print(f"{m['name']} ({m['parameters'] / 1e6:.1f}M params), {r['nproc']} ranks x {r['threads_per_rank']} thread(s), "
          f"{r['backend']}, batch {r['batch_per_rank']}x{r['seq_len']} per rank, bucket {r['bucket_mb']} MiB")
    print(f"{'':24}{'step (median s)':>16}{'peak RSS (MiB)':>16}")
    for label, key in (("shardwise DataParallel", "ours"), ("torch DDP", "torch_ddp"), ("no sync (baseline)", "plain")):
        if key not in r:
            continue
        step = r[key].get("step_s_median")
        rss = r[key].get("peak_rss_mb")
        print(f"{label:24}{f'{step:.4f}' if step else '-':>16}{f'{rss:.0f}' if rss else '-':>16}")
    line = (f"ratio ours/torch: step time {r['ratio_step_time']:.3f} "
            f"(median of per-step ratios {r['ratio_step_time_paired_median']:.3f})")
    if "ratio_peak_rss" in r:
        line += f", peak RSS {r['ratio_peak_rss']:.3f}"
    print(line + f"; max loss difference {r['max_loss_difference']:.2e}; written to {out}")
    for label, key in (("ours", "ours"), ("torch DDP", "torch_ddp"), ("no sync", "plain")):
        if "phase_s_median" in r.get(key, {}):
            print(f"  {label:10} median s: " + ", ".join(f"{ph} {v:.4f}" for ph, v in r[key]["phase_s_median"].items()))
    print(f"  CPU time (process, all threads) ours/torch, median of per-step ratios: "
          f"{r['ratio_cpu_time_paired_median']:.3f}")


if __name__ == "__main__":
    main()
