"""Benchmark: ZeRO-3 inside a pipeline (pp 2 x dp 2) against torch's own composition, side by side.

Ours is the trainer's engine (``shardwise.train.engine.Engine``: pipeline stages -> ZeRO-3 over the data-parallel
replicas of each stage -> a pipeline schedule; gradients accumulated unsharded and reduce-scattered once after
the flush, each stage's units gathered from its first forward to the flush). The peer is
``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe`` /
``ScheduleInterleaved1F1B``) over stages wrapped by ``fully_shard`` (FSDP2: every block, then the stage) on a
(pp, dp) ``DeviceMesh`` -- torchtitan's composition, which makes the same two choices (``reshard_after_forward``
off in a pipeline, gradient sync only on the last backward). The same model (GPT-2 shape, untied embedding and
head, since torch's stages keep no tied copies), the same split, weights, schedule, micro-batches, data and
AdamW; fp32, gloo, 4 ranks, one intra-op thread each.

* step time: both engines live in the same processes and alternate step by step (the one going first rotates),
  so machine drift hits both alike; reported is the median of the slowest rank's step time (forward and
  backward of every micro-batch, the data-parallel reduction, the optimizer step), and the ratio ours / torch;
* memory: one set of fresh processes per engine, each training alone for the same steps; peak RSS
  (``ru_maxrss``, max over ranks), and its growth over the RSS before the model was built;
* losses: the mean loss of every replica's micro-batches, every step, from both engines in the timing run --
  equal up to the order of the floating-point sums.

    python bench/bench_pp_fsdp.py                      # 1F1B, writes bench/results/pp_fsdp.json
    python bench/bench_pp_fsdp.py --schedule interleaved --steps 6

Memory: workers start with ``MALLOC_MMAP_THRESHOLD_=65536`` (as bench_zero.py), so freed tensors go back to
the system and RSS follows the live tensors for both engines alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shardwise.dist import free_port, shutdown_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import _Logits, _loss  # noqa: E402 - a stage as torch's pipelining calls it, and its loss

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pp_fsdp.json"
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}
PP, DP = 2, 2
ENGINES = ("ours", "torch")


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def config(args):
    """The resolved trainer config of the layout both engines run."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve

    overrides = {"model.preset": "cpu-demo", "model.d_model": args.d_model, "model.n_layers": args.n_layers,
                 "model.tie_embeddings": "false", "data.seq_len": args.seq_len, "model.max_seq_len": args.seq_len,
                 "parallel.nproc": PP * DP, "parallel.pp": PP, "parallel.dp": DP, "parallel.zero": 3,
                 "parallel.pp_schedule": args.schedule, "parallel.microbatches": args.microbatches,
                 "parallel.pp_virtual": 2 if args.schedule == "interleaved" else 1, "train.precision": "fp32",
                 "train.global_batch": DP * args.microbatches * args.micro_batch, "train.grad_clip": 0}
    return resolve(Config.load(overrides={k: str(v) for k, v in overrides.items()}), world_size=PP * DP,
                   tokenizer_vocab=257)


def build_ours(cfg, run_dir: str):
    """Our engine over this rank's stages; ``step(x, y)`` trains one global step and returns the replica's loss."""
    from shardwise.dist.mesh import ParallelDims
    from shardwise.train.engine import Engine

    mesh = ParallelDims.from_config(cfg.parallel, PP * DP).build("cpu")
    engine = Engine(cfg, mesh, torch.device("cpu"), Path(run_dir))

    def step(x, y):
        batches = list(zip(x.chunk(cfg.parallel.microbatches), y.chunk(cfg.parallel.microbatches), strict=True))
        loss = engine.forward_backward(batches, "fp32", None)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def build_torch(cfg):
    """torch.distributed.pipelining stages, each ``fully_shard``-ed over the dp ranks of its stage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from shardwise.parallel.pipeline.checks import pipeline_partition
    from shardwise.parallel.pipeline.partition import build_stage, partition
    from shardwise.train.optim import build_optimizer

    p = cfg.parallel
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, n_stages = mesh["pp"].get_local_rank(), PP * p.pp_virtual
    method, boundaries = pipeline_partition(p.pp_partition)
    split = partition(cfg.model, n_stages, method, boundaries, seq_len=cfg.data.seq_len)
    stage_ids = [c * PP + pp_rank for c in range(p.pp_virtual)]
    modules, stages = [], []
    for s in stage_ids:
        module = _Logits(build_stage(cfg.model, s, n_stages, split[s], cfg.train.seed))
        for block in module.stage.blocks.values():  # torchtitan: every block, then the root; kept over the step
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
        modules.append(module)
        stages.append(PipelineStage(module, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule_cls = getattr(torch_schedules, TORCH_SCHEDULES[p.pp_schedule])
    schedule = schedule_cls(stages if p.pp_virtual > 1 else stages[0], p.microbatches, loss_fn=_loss)
    named = [(n.removeprefix("stage."), q) for m in modules for n, q in m.named_parameters()]
    optimizer = build_optimizer(nn.ModuleList(modules), cfg.train, named)
    first, last = pp_rank == 0, pp_rank == PP - 1
    pp_group = mesh["pp"].get_group()

    def step(x, y):
        losses: list = []
        if first:
            schedule.step(x, target=y if last else None, losses=losses)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).detach().mean().double() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(loss, group=pp_group)  # the last stage's, on every stage of the replica
        return float(loss)

    return step


def _batches(cfg, args, dp_rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each replica's own tokens and targets for every step (the same for both engines)."""
    g = torch.Generator().manual_seed(1000 + dp_rank)
    rows = args.microbatches * args.micro_batch
    return [(torch.randint(0, 257, (rows, args.seq_len), generator=g),
             torch.randint(0, 257, (rows, args.seq_len), generator=g)) for _ in range(steps)]


def _timed(step, x, y) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = step(x, y)
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t), loss


def _time_worker(rank: int, port: int, args, queue) -> None:
    """Both engines in the same processes, alternating step by step with the first one rotating."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PP * DP)
    cfg = config(args)
    with tempfile.TemporaryDirectory() as run_dir:
        steps = {"ours": build_ours(cfg, run_dir), "torch": build_torch(cfg)}
        data = _batches(cfg, args, rank % DP, args.warmup + args.steps)
        times = {e: [] for e in ENGINES}
        losses = {e: [] for e in ENGINES}
        for i, (x, y) in enumerate(data):
            for e in ENGINES[i % 2:] + ENGINES[:i % 2]:
                t, loss = _timed(steps[e], x, y)
                losses[e].append(loss)
                if i >= args.warmup:
                    times[e].append(t)
    diff = torch.tensor([max(abs(a - b) for a, b in zip(losses["ours"], losses["torch"], strict=True))])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    replica_losses = [None] * (PP * DP)
    dist.all_gather_object(replica_losses, losses)
    if rank == 0:
        queue.put({"step_s": times, "loss_max_abs_diff": float(diff),
                   "losses": {e: [replica_losses[r][e] for r in range(DP)] for e in ENGINES}})
    shutdown_distributed()


def _memory_worker(rank: int, port: int, engine: str, args, queue) -> None:
    """One engine alone in fresh processes: its peak RSS."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PP * DP)
    cfg = config(args)
    rss0 = _rss()
    with tempfile.TemporaryDirectory() as run_dir:
        step = build_ours(cfg, run_dir) if engine == "ours" else build_torch(cfg)
        for x, y in _batches(cfg, args, rank % DP, args.warmup + args.steps):
            step(x, y)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mem = torch.tensor([peak, peak - rss0], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"peak_rss_bytes": int(mem[0]), "peak_rss_above_start_bytes": int(mem[1])})
    shutdown_distributed()


def _launch(fn, *what, attempts: int = 3):
    """Run ``fn`` on PP * DP fresh processes; its rank 0's answer. A free port taken by another job between
    choosing it and listening on it (EADDRINUSE, on a shared machine) is retried on a new port."""
    ctx = mp.get_context("spawn")
    for attempt in range(attempts):
        queue = ctx.SimpleQueue()
        try:
            mp.start_processes(fn, args=(free_port(), *what, queue), nprocs=PP * DP, start_method="spawn")
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == attempts - 1:
                raise
            continue
        return queue.get()
    raise AssertionError("unreachable")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b", choices=list(TORCH_SCHEDULES))
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=8, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--mmap-threshold", type=int, default=65536,
                   help="MALLOC_MMAP_THRESHOLD_ for the workers (glibc; 0: leave the allocator's default)")
    p.add_argument("--json", default=str(RESULTS))
    add_machine_note(p)
    args = p.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    if args.mmap_threshold:  # read by glibc at start-up of each spawned worker
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    timed = _launch(_time_worker, args)
    memory = {e: _launch(_memory_worker, e, args) for e in ENGINES}
    runs = {e: {"step_s": timed["step_s"][e], "step_s_median": statistics.median(timed["step_s"][e]),
                **memory[e], "losses": timed["losses"][e]} for e in ENGINES}
    ours, peer = runs["ours"], runs["torch"]
    ratios = {"step_time": ours["step_s_median"] / peer["step_s_median"],
              "step_time_per_step_median": statistics.median(
                  a / b for a, b in zip(ours["step_s"], peer["step_s"], strict=True)),
              "peak_rss": ours["peak_rss_bytes"] / peer["peak_rss_bytes"],
              "peak_rss_above_start": ours["peak_rss_above_start_bytes"] / peer["peak_rss_above_start_bytes"]}
    cfg = config(args)
    with torch.device("meta"):
        from shardwise.model import Transformer

        n_params = Transformer(cfg.model).num_parameters()
    out = {"benchmark": "ZeRO-3 inside a pipeline (pp 2 x dp 2): shardwise vs torch.distributed.pipelining "
                        "stages wrapped by fully_shard",
           "torch": torch.__version__,
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "backend": "gloo", "precision": "fp32",
           "schedule": args.schedule, "microbatches": args.microbatches, "micro_batch": args.micro_batch,
           "d_model": args.d_model, "n_layers": args.n_layers, "seq_len": args.seq_len, "parameters": n_params,
           "warmup": args.warmup, "steps": args.steps, "malloc_mmap_threshold": args.mmap_threshold,
           "loss_max_abs_diff": timed["loss_max_abs_diff"], "runs": runs, "ratios": ratios}
    bench_run.write(args.json, out)
    print(f"model {n_params / 1e6:.1f}M parameters, fp32, gloo, pp {PP} x dp {DP}, ZeRO-3, {args.schedule}, "
          f"{args.microbatches} micro-batches of {args.micro_batch}")
    for e in ENGINES:
        r = runs[e]
        print(f"  {e:<6} step {r['step_s_median']:.3f} s   peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB "
              f"(+{r['peak_rss_above_start_bytes'] / 2**20:.0f} MiB over start)")
    print(f"ratios ours / torch: step time {ratios['step_time']:.2f} (per-step median "
          f"{ratios['step_time_per_step_median']:.2f}), peak RSS {ratios['peak_rss']:.2f} "
          f"(above start {ratios['peak_rss_above_start']:.2f}); losses equal within {timed['loss_max_abs_diff']:.1e}")
    return out


if __name__ == "__main__":
    main()
