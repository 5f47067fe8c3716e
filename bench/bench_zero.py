"""Benchmark: our ZeRO-1/2/3 against torch's ``ZeroRedundancyOptimizer`` and ``fully_shard`` (FSDP2), and DeepSpeed.

Every variant trains the same shardwise Transformer (``cpu-demo`` shape, widened to ~25M
parameters) with AdamW in fp32. Step time (forward + backward + optimizer step, slowest rank) is
measured with all variants in the same processes, interleaved step by step with rotating order;
memory in a fresh set of processes per (variant, world size), so that each process's peak RSS
belongs to one variant. Reported per variant: the median step time, the peak RSS (max over
ranks), the peak RSS above the RSS before the model was built ("state + activations", where the
variants differ) and the largest RSS sampled during training steps; then the ratios ours / peer:

* ZeRO-1 and ZeRO-2 against ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` (stage 1);
* ZeRO-3 against ``fully_shard`` applied to every block and to the root (stage 3);
* ZeRO-1/2/3 against DeepSpeed's ZeRO of the same stage (``deepspeed.initialize`` with the same model, data,
  seed and ``torch.optim.AdamW`` as a client optimizer, fp32, no clipping; DeepSpeed's CPU accelerator,
  ``DS_ACCELERATOR=cpu``, on the same gloo group), when DeepSpeed is installed (``pip install 'shardwise[bench]'``,
  DeepSpeed 0.19.8): step time, peak RSS and the largest per-step difference of the losses (rank 0's batch,
  from the single-variant runs).

    python bench/bench_zero.py                       # 2 and 4 ranks, writes bench/results/zero.json
    python bench/bench_zero.py --worlds 2 --steps 5  # quicker
    python bench/bench_zero.py --worlds 2 --variants zero1 zero2 zero3 deepspeed1 deepspeed2 deepspeed3

Memory: worker processes start with ``MALLOC_MMAP_THRESHOLD_=65536`` (``--mmap-threshold``), for
every variant alike. glibc otherwise raises its mmap threshold dynamically after the first large
free, after which freed tensors stay in the heap and RSS no longer follows the live tensors
(ours and the peers' RSS then grow step after step with allocator churn, not with state).

Variants run one after another, so drift on a shared machine is not cancelled as in
bench_ddp.py's interleaving; rerun to see the spread.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.bench_result import BenchRun, add_machine_note
from shardwise.dist import free_port, shutdown_distributed

RESULTS = Path(__file__).resolve().parent / "results" / "zero.json"
DEEPSPEED = ("deepspeed1", "deepspeed2", "deepspeed3")
VARIANTS = ("zero1", "torch_zero_redundancy", "zero2", "zero3", "torch_fully_shard", *DEEPSPEED)
PAIRS = (("zero1", "torch_zero_redundancy"), ("zero2", "torch_zero_redundancy"), ("zero3", "torch_fully_shard"),
         ("zero1", "deepspeed1"), ("zero2", "deepspeed2"), ("zero3", "deepspeed3"))


def have_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_model(args):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer

    overrides = {"model.preset": "cpu-demo", "model.d_model": str(args.d_model),
                 "model.n_layers": str(args.n_layers), "data.seq_len": str(args.seq_len)}
    if getattr(args, "n_heads", None):
        overrides["model.n_heads"] = str(args.n_heads)
    cfg = resolve(Config.load(overrides=overrides), world_size=2, tokenizer_vocab=257).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.reset_parameters(0)
    return model


def _wrap(variant: str, model, args):
    """(callable model, optimizer) for one variant."""
    adamw = {"lr": 1e-4, "weight_decay": 0.1}
    if variant.startswith("zero"):
        from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer

        engine = ZeroDataParallel(model, stage=int(variant[-1]), bucket_mb=args.bucket_mb)
        return engine, ZeroOptimizer(engine, torch.optim.AdamW(model.parameters(), **adamw))
    if variant == "torch_zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    if variant == "torch_fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if variant in DEEPSPEED:  # the same AdamW as DeepSpeed's client optimizer, fp32, its ZeRO of that stage
        import deepspeed

        for key, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", dist.get_rank()),
                           ("WORLD_SIZE", dist.get_world_size())):
            os.environ.setdefault(key, str(value))  # what a launcher sets; the gloo group is ours already
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": int(variant[-1]),
                                        "reduce_bucket_size": int(args.bucket_mb * 2**20 / 4),
                                        "allgather_bucket_size": int(args.bucket_mb * 2**20 / 4)},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
                  "fp16": {"enabled": False}, "bf16": {"enabled": False}, "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **adamw),
                                               config=config, dist_init_required=False)
        return engine, None
    raise ValueError(variant)


def _train_step(net, opt, x) -> torch.Tensor:
    """Forward, backward, optimizer step and zeroed gradients of one batch; the loss."""
    loss = net(x, x)
    if opt is None:  # a DeepSpeed engine steps (and zeroes) itself
        net.backward(loss)
        net.step()
        return loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _worker(rank: int, world: int, port: int, variant: str, args, queue) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rss0 = _rss()
    net, opt = _wrap(variant, build_model(args), args)
    g = torch.Generator().manual_seed(1000 + rank)
    times, losses, sampled = [], [], 0
    for step in range(args.warmup + args.memory_steps):
        x = torch.randint(0, 257, (args.batch, args.seq_len), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = _train_step(net, opt, x)
        sampled = max(sampled, _rss())
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(float(t))
            losses.append(float(loss.detach()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mem = torch.tensor([peak, peak - rss0, sampled - rss0], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"step_s_median": statistics.median(times), "step_s": times, "losses": losses,
                   "peak_rss_bytes": int(mem[0]), "peak_rss_above_start_bytes": int(mem[1]),
                   "training_rss_above_start_bytes": int(mem[2]),
                   "parameters": sum(p.numel() for p in build_model(args).parameters())})
    shutdown_distributed()


def _time_worker(rank: int, world: int, port: int, variants: list[str], args, queue) -> None:
    """All variants in the same processes, one model each; every step runs each variant once, the
    order rotating from step to step, so machine drift hits all of them alike (as bench_ddp.py)."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    nets = {v: _wrap(v, build_model(args), args) for v in variants}
    g = torch.Generator().manual_seed(1000 + rank)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, 257, (args.batch, args.seq_len), generator=g)
        order = variants[step % len(variants):] + variants[:step % len(variants)]
        for v in order:
            net, opt = nets[v]
            dist.barrier()
            t0 = time.perf_counter()
            _train_step(net, opt, x)
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times[v].append(float(t))
    if rank == 0:
        queue.put(times)
    shutdown_distributed()


def _launch(fn, what, world: int, args):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(fn, args=(world, free_port(), what, args, queue), nprocs=world, start_method="spawn")
    return queue.get()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="numbers of ranks")
    p.add_argument("--variants", nargs="+", choices=VARIANTS,
                   help="default: every variant (DeepSpeed's where it is installed)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-steps", type=int, default=3, help="steps of each single-variant memory run")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--mmap-threshold", type=int, default=65536,
                   help="MALLOC_MMAP_THRESHOLD_ for the workers (glibc; 0: leave the allocator's default)")
    p.add_argument("--json", default=str(RESULTS))
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    if args.variants is None:
        args.variants = [v for v in VARIANTS if v not in DEEPSPEED or have_deepspeed()]
    if any(v in DEEPSPEED for v in args.variants):
        if not have_deepspeed():
            p.error("the DeepSpeed variants need DeepSpeed: pip install 'shardwise[bench]' (deepspeed==0.19.8)")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, read by the workers
    if args.mmap_threshold:  # read by glibc at start-up of each spawned worker
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    out = {"benchmark": "ZeRO: shardwise ZeRO-1/2/3 vs torch ZeroRedundancyOptimizer and fully_shard",
           "torch": torch.__version__,
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "backend": "gloo",
           "precision": "fp32", "d_model": args.d_model, "n_layers": args.n_layers, "seq_len": args.seq_len,
           "batch_per_rank": args.batch, "warmup": args.warmup, "steps": args.steps,
           "malloc_mmap_threshold": args.mmap_threshold, "worlds": {}}
    for world in args.worlds:
        runs = {}
        timed = _launch(_time_worker, list(args.variants), world, args)
        for v in args.variants:
            runs[v] = _launch(_worker, v, world, args)  # memory: one variant per set of processes
            runs[v]["alone_step_s_median"] = runs[v].pop("step_s_median")
            runs[v]["alone_step_s"] = runs[v].pop("step_s")
            runs[v]["step_s"] = timed[v]
            runs[v]["step_s_median"] = statistics.median(timed[v])
            print(f"world {world} {v:<24} step {runs[v]['step_s_median']:.3f}s  "
                  f"peak RSS {runs[v]['peak_rss_bytes'] / 2**20:.0f} MiB "
                  f"(+{runs[v]['peak_rss_above_start_bytes'] / 2**20:.0f} MiB; in training "
                  f"+{runs[v]['training_rss_above_start_bytes'] / 2**20:.0f} MiB)", flush=True)
        ratios = {}
        for ours, peer in PAIRS:
            if ours in runs and peer in runs:
                a, b = runs[ours], runs[peer]
                ratios[f"{ours}/{peer}"] = {
                    "step_time": a["step_s_median"] / b["step_s_median"],
                    "step_time_per_step_median": statistics.median(
                        x / y for x, y in zip(a["step_s"], b["step_s"], strict=True)),
                    "peak_rss": a["peak_rss_bytes"] / b["peak_rss_bytes"],
                    "peak_rss_above_start": a["peak_rss_above_start_bytes"] / b["peak_rss_above_start_bytes"],
                    "training_rss_above_start": a["training_rss_above_start_bytes"]
                    / b["training_rss_above_start_bytes"],
                    "loss_max_abs_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
                }
        out["worlds"][str(world)] = {"runs": runs, "ratios": ratios}
        out["parameters"] = next(iter(runs.values()))["parameters"]
    bench_run.write(args.json, out)
    print(f"\nmodel {out['parameters'] / 1e6:.1f}M parameters, fp32, gloo; ratios ours / peer:")
    print(f"{'ranks':<6}{'pair':<38}{'step time':>10}{'peak RSS':>10}{'peak above start':>18}"
          f"{'training RSS above start':>26}{'max |loss diff|':>17}")
    for world, r in out["worlds"].items():
        for pair, q in r["ratios"].items():
            print(f"{world:<6}{pair:<38}{q['step_time']:>10.2f}{q['peak_rss']:>10.2f}"
                  f"{q['peak_rss_above_start']:>18.2f}{q['training_rss_above_start']:>26.2f}"
                  f"{q['loss_max_abs_diff']:>17.2e}")
    return out


if __name__ == "__main__":
    main()
