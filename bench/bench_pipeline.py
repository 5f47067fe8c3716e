"""Benchmark: our pipeline schedules against torch.distributed.pipelining, side by side.

In the same worker processes, the same model split the same way (even split of blocks, embedding on
the first stage, head on the last; identical weights) runs one training step (forward + backward of
every micro-batch, no optimizer) with our ``Pipeline`` and with torch's ``PipelineStage`` +
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``. After a warm-up the timed steps
alternate ours/torch, the one going first rotating every step. The report is the median step time
(slowest rank) of each, the ratio of the medians ours/torch and the median of per-step ratios; the
losses of both are compared as a check. Our measured bubble and the theoretical one are reported too, with the
bubble of the schedule replayed with our measured compute times and free communication
(:func:`~shardwise.parallel.pipeline.timeline.replayed_bubble`; its makespan, ``ideal_s``, is the shortest step
any executor of the schedule could take with these computations, so ``ratio_ideal_over_torch`` is the best
ratio to torch reachable without making the stages' own forward and backward faster).

    python bench/bench_pipeline.py --nproc 2 --schedules gpipe 1f1b --steps 10
    python bench/bench_pipeline.py --nproc 2 4 --schedules gpipe 1f1b interleaved   # the full table

gloo on CPU, one intra-op thread per rank.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from shardwise.bench_result import BenchRun, add_machine_note
from shardwise.dist import free_port, shutdown_distributed

RESULTS = Path(__file__).resolve().parent / "results"
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def _cfg(args):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve

    overrides = {"model.preset": args.preset, "model.n_layers": str(args.n_layers), "data.seq_len": str(args.seq_len)}
    return resolve(Config.load(overrides=overrides), world_size=1, tokenizer_vocab=257).model


class _Logits(nn.Module):
    """torch.distributed.pipelining calls ``stage(x)`` and applies ``loss_fn`` to the last output."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        return self.stage(x)


def _loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _timed(fn) -> tuple[float, float]:
    import time

    dist.barrier()
    t0 = time.perf_counter()
    loss = fn()
    out = torch.tensor([time.perf_counter() - t0, 0.0 if loss is None else float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(out[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(out[1:])  # only the last stage contributes its loss
    return out[0].item(), out[1].item()


def _worker(rank: int, nproc: int, args, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from torch.distributed import pipelining as tpp

    from shardwise.dist import init_distributed
    from shardwise.parallel.pipeline import Pipeline, bubble_fraction, build_schedule, build_stage, gather_timelines
    from shardwise.parallel.pipeline import replayed_bubble as replayed
    from shardwise.parallel.pipeline import theoretical_bubble as theory
    from shardwise.parallel.pipeline.partition import partition

    init_distributed("gloo", timeout_s=600)
    cfg = _cfg(args)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    results = {}
    for schedule in args.schedules:
        v = 2 if schedule == "interleaved" else 1
        m = args.microbatches
        n_stages = nproc * v
        if n_stages > cfg.n_layers or (schedule == "interleaved" and m % nproc):
            continue
        split = partition(cfg, n_stages, "even")
        stage_ids = [c * nproc + rank for c in range(v)]
        ours = Pipeline([build_stage(cfg, s, n_stages, split[s], seed=1) for s in stage_ids], list(range(nproc)),
                        schedule, m, d_model=cfg.d_model)
        peer_modules = [_Logits(build_stage(cfg, s, n_stages, split[s], seed=1)) for s in stage_ids]
        peer_stages = [tpp.PipelineStage(mod, s, n_stages, torch.device("cpu"))
                       for mod, s in zip(peer_modules, stage_ids, strict=True)]
        cls = getattr(tpp, TORCH_SCHEDULES[schedule])
        peer = cls(peer_stages if v > 1 else peer_stages[0], m, loss_fn=_loss)

        def run_ours(ours=ours):
            return ours.step(tokens, targets)

        def run_peer(peer=peer):
            losses: list = []
            if rank == 0:
                peer.step(tokens, target=targets if rank == nproc - 1 else None, losses=losses)
            elif rank == nproc - 1:
                peer.step(target=targets, losses=losses)
            else:
                peer.step()
            return torch.stack(losses).mean() if losses and rank == nproc - 1 else None

        times = {"ours": [], "torch": []}
        losses = {"ours": [], "torch": []}
        bubbles, replays, ideal = [], [], []
        actions = build_schedule(schedule, nproc, m, v)
        for step in range(args.warmup + args.steps):
            order = [("ours", run_ours), ("torch", run_peer)][:: 1 if step % 2 == 0 else -1]
            for name, fn in order:
                for mod in [*ours.chunks, *peer_modules]:
                    mod.zero_grad(set_to_none=True)
                seconds, loss = _timed(fn)
                if step >= args.warmup:
                    times[name].append(seconds)
                    losses[name].append(loss)
                    if name == "ours":
                        tls = gather_timelines(ours.timeline)
                        bubble, makespan = replayed(tls, actions)
                        bubbles.append(bubble_fraction(tls))
                        replays.append(bubble)
                        ideal.append(makespan)
            if step == args.warmup + args.steps - 1 and args.timeline_png and nproc == args.nproc[0] \
                    and schedule == args.schedules[-1]:
                tls = gather_timelines(ours.timeline)
                if rank == 0:
                    from shardwise.parallel.pipeline import plot_gantt, write_chrome_trace

                    plot_gantt(tls, args.timeline_png, title=f"ours {schedule} p={nproc} m={m} v={v}")
                    write_chrome_trace(tls, Path(args.timeline_png).with_suffix(".trace.json"))
        med = {k: statistics.median(t) for k, t in times.items()}
        results[schedule] = {
            "torch_schedule": TORCH_SCHEDULES[schedule], "microbatches": m, "virtual": v,
            "median_s": med, "ratio_ours_over_torch": med["ours"] / med["torch"],
            "median_step_ratio": statistics.median(a / b for a, b in zip(times["ours"], times["torch"], strict=True)),
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["ours"], losses["torch"], strict=True)),
            "bubble_measured": statistics.median(bubbles), "bubble_theory": theory(nproc, m, v),
            "bubble_replayed": statistics.median(replays), "ideal_s": statistics.median(ideal),
            "ratio_ideal_over_torch": statistics.median(ideal) / med["torch"],
        }
    if rank == 0:
        queue.put(results)
    shutdown_distributed()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=list(TORCH_SCHEDULES))
    p.add_argument("--preset", default="cpu-demo")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=RESULTS / "pipeline.json")
    p.add_argument("--timeline-png", type=Path, default=RESULTS / "pipeline_timeline.png")
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    report = {"host": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
              "model": {"preset": args.preset, "n_layers": args.n_layers, "seq_len": args.seq_len, "batch": args.batch},
              "runs": {}}
    for nproc in args.nproc:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(nproc, args, free_port(), queue), nprocs=nproc, start_method="spawn")
        report["runs"][str(nproc)] = queue.get()
    bench_run.write(args.json, report)
    print(f"{'ranks':>5} {'schedule':>12} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} {'ideal ms':>9} {'bound':>6} "
          f"{'bubble':>7} {'replay':>7} {'theory':>7}")
    for nproc, runs in report["runs"].items():
        for schedule, r in runs.items():
            print(f"{nproc:>5} {schedule:>12} {r['median_s']['ours'] * 1e3:9.1f} {r['median_s']['torch'] * 1e3:9.1f} "
                  f"{r['ratio_ours_over_torch']:6.3f} {r['ideal_s'] * 1e3:9.1f} {r['ratio_ideal_over_torch']:6.3f} "
                  f"{r['bubble_measured']:7.1%} {r['bubble_replayed']:7.1%} {r['bubble_theory']:7.1%}")
    return report


if __name__ == "__main__":
    main()
