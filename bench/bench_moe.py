"""Benchmark: expert parallelism at ep 1, 2, 4 (gloo), our all-to-all against the backend's, and load balance.

Part 1, speed. ``--nproc`` workers run the same mixture-of-experts GPT (``shardwise.model``, E experts
top-k) on random tokens, data parallel over all workers, with the experts split over ep = 1, 2, 4 (every
ep that divides nproc and E): forward + backward + AdamW per step, gradients synchronised by
``shardwise.parallel.data.DataParallel`` (dense over dp, experts over their replicas). At ep > 1 the
all-to-all is ours ("pairwise", :func:`shardwise.dist.comm.collectives.all_to_all_v`) and the backend's
("native": ``all_to_all_single``, the peer), alternating step by step in the same processes. Reported: the
median step time (slowest rank), tokens per second, the time spent inside the all-to-alls (summed per
step, slowest rank) and the ratio ours / native of both.

Part 2, load balance (``--balance-steps``, 0 skips it): the trainer (``shardwise.train.loop.train``) runs
the tiny MoE preset on the stdlib corpus with the Switch load-balancing loss on and off, and the last
step's ``moe_tokens_per_expert_max / mean`` (1 = perfectly balanced) and ``moe_aux_loss`` are reported.

    python bench/bench_moe.py --nproc 4 --steps 20

Results go to bench/results/moe.json. Timings on a shared or oversubscribed machine are not meaningful.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.bench_result import BenchRun, add_machine_note
from shardwise.dist import free_port, shutdown_distributed

RESULTS = Path(__file__).resolve().parent / "results"


def build_model(args, ep_group, algorithm: str):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer
    from shardwise.parallel.expert.dispatch import apply_expert_parallel

    overrides = {"model.preset": "tiny-moe", "model.d_model": str(args.d_model), "model.n_layers": str(args.n_layers),
                 "model.n_heads": "4", "model.d_ff": str(2 * args.d_model), "model.n_experts": str(args.experts),
                 "model.moe_top_k": str(args.top_k), "model.vocab_size": "512",
                 "model.max_seq_len": str(args.seq_len), "data.seq_len": str(args.seq_len)}
    cfg = resolve(Config.load(overrides=overrides), tokenizer_vocab=512).model
    model = Transformer(cfg)
    model.reset_parameters(0)
    if ep_group is not None:
        apply_expert_parallel(model, ep_group, algorithm=algorithm)
    return model


class _A2ATimer:
    """Seconds spent inside the expert all-to-alls (wraps the function parallel/expert/dispatch.py calls)."""

    def __init__(self):
        import shardwise.parallel.expert.dispatch as expert

        self.seconds, self._inner, self._module = 0.0, expert.all_to_all_v, expert

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return self._inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        expert.all_to_all_v = timed

    def pop(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from shardwise.dist import init_distributed
    from shardwise.dist.mesh import ParallelDims
    from shardwise.parallel.data import DataParallel

    init_distributed("gloo", timeout_s=600)
    timer = _A2ATimer()
    out = {}
    for ep in [e for e in (1, 2, 4) if args.nproc % e == 0 and args.experts % e == 0]:
        mesh = ParallelDims(dp=args.nproc, ep=ep).build("cpu")
        algorithms = ["native", "pairwise"] if ep > 1 else ["-"]
        nets = {}
        for alg in algorithms:
            model = build_model(args, mesh.group("ep") if ep > 1 else None, alg)
            dp = DataParallel(model, group=mesh.dp_group, expert_group=mesh.group("edp") if ep > 1 else None)
            nets[alg] = (dp, torch.optim.AdamW(model.parameters(), lr=1e-3))
        times = {a: [] for a in algorithms}
        a2a = {a: [] for a in algorithms}
        gen = torch.Generator().manual_seed(rank)
        for step in range(args.warmup + args.steps):
            order = algorithms[step % len(algorithms):] + algorithms[:step % len(algorithms)]
            for alg in order:
                dp, opt = nets[alg]
                x = torch.randint(0, 512, (args.batch, args.seq_len), generator=gen)
                timer.pop()
                dist.barrier()
                t0 = time.perf_counter()
                dp(x, x).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                slowest = torch.tensor([time.perf_counter() - t0, timer.pop()], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    times[alg].append(slowest[0].item())
                    a2a[alg].append(slowest[1].item())
        out[ep] = {"times": times, "a2a": a2a}
    if rank == 0:
        queue.put(out)
    shutdown_distributed()


def balance_configs(args, tmp: str) -> dict:
    """The trainer's configs for the load-balance part, resolved in the parent (which prepares the corpus)."""
    from shardwise.config import Config
    from shardwise.launch import prepare_run

    out = {}
    for coeff in (0.0, 0.01):
        out[coeff], _ = prepare_run(Config.load(overrides={
            "model.preset": "tiny-moe", "model.moe_aux_coeff": str(coeff), "data.seq_len": "64",
            "data.max_bytes": "2000000", "train.steps": str(args.balance_steps), "train.global_batch": "8",
            "train.eval_every": "0", "parallel.nproc": str(args.nproc), "run.dir": f"{tmp}/aux{coeff}",
            "run.progress": "false", "run.tensorboard": "false", "ckpt.every": "0"}))
    return out


def _balance_worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from shardwise.dist import init_distributed
    from shardwise.train.loop import train
    from shardwise.train.metrics import read_metrics

    init_distributed("gloo", timeout_s=600)
    out = {}
    for coeff, cfg in args.configs.items():
        run_dir = Path(cfg.run.dir)
        train(cfg, run_dir)
        if rank == 0:
            last = [r for r in read_metrics(run_dir) if "moe_tokens_per_expert_max" in r][-1]
            out[coeff] = {"max_over_mean": last["moe_tokens_per_expert_max"] / last["moe_tokens_per_expert_mean"],
                          "min_over_mean": last["moe_tokens_per_expert_min"] / last["moe_tokens_per_expert_mean"],
                          "moe_aux_loss": last["moe_aux_loss"], "loss": last["loss"]}
    if rank == 0:
        queue.put(out)
    shutdown_distributed()


def _launch(fn, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(fn, args=(args, free_port(), queue), nprocs=args.nproc, start_method="spawn")
    return queue.get()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="worker processes (= dp; ep takes 1, 2, 4 of them)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--balance-steps", type=int, default=100, help="trainer steps with and without the aux loss")
    p.add_argument("--json", default=str(RESULTS / "moe.json"))
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)

    speed = _launch(_worker, args)
    rows = {}
    for ep, r in speed.items():
        for alg, times in r["times"].items():
            step = statistics.median(times)
            rows[f"ep{ep} {alg}"] = {"ep": ep, "all_to_all": alg, "step_s": step,
                                     "tokens_per_s": args.nproc * args.batch * args.seq_len / step,
                                     "a2a_s": statistics.median(r["a2a"][alg])}
    for ep in speed:
        if ep > 1:
            ours, native = rows[f"ep{ep} pairwise"], rows[f"ep{ep} native"]
            ours["step_ratio_vs_native"] = ours["step_s"] / native["step_s"]
            ours["a2a_ratio_vs_native"] = ours["a2a_s"] / native["a2a_s"] if native["a2a_s"] else None
    balance = {}
    if args.balance_steps:
        with tempfile.TemporaryDirectory() as tmp:
            args.configs = balance_configs(args, tmp)
            balance = _launch(_balance_worker, args)
    result = {
        "benchmark": "expert parallelism: ep 1/2/4, our pairwise all-to-all vs the backend's; load balance",
        "torch": torch.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "backend": "gloo", "args": {k: v for k, v in vars(args).items() if k != "configs"},
        "speed": rows, "balance": {f"aux_coeff={k}": v for k, v in balance.items()},
    }
    bench_run.write(args.json, result)
    print(f"{'layout':<16} {'step s':>9} {'tokens/s':>10} {'a2a s':>9} {'ours/native step':>17} {'a2a':>7}")
    for name, r in rows.items():
        ratio = f"{r['step_ratio_vs_native']:.2f}" if "step_ratio_vs_native" in r else ""
        a2a = f"{r['a2a_ratio_vs_native']:.2f}" if r.get("a2a_ratio_vs_native") else ""
        print(f"{name:<16} {r['step_s']:>9.4f} {r['tokens_per_s']:>10,.0f} {r['a2a_s']:>9.4f} {ratio:>17} {a2a:>7}")
    for coeff, b in result["balance"].items():
        print(f"{coeff}: tokens per expert max/mean {b['max_over_mean']:.2f}, min/mean {b['min_over_mean']:.2f}, "
              f"aux loss {b['moe_aux_loss']:.3f}")
    print(f"written to {args.json}")
    return result


if __name__ == "__main__":
    main()
