"""Benchmark: what one steady-state training step costs the host of a GPU -- operators dispatched (each a kernel
launch on a GPU), host synchronisations by kind and call site, collectives and their bytes, the Python time outside
the operators -- for our trainer and for torch's own implementation of the same layout on the same model, counted
on any device by :mod:`shardwise.dispatch_count`.

Ours is the trainer users run (``shardwise.train.loop.train``, or the parameter server's runner): the window opens
when the loop calls ``Engine.forward_backward`` for the step after ``--warmup`` steps and closes at the next call,
so it holds one whole cycle of the loop (the batch's upload, forward, backward, norm and clip, the optimizer, the
loss and metrics) whatever the loop does. torch's is the shortest loop over the same ``Transformer``: the batch
uploaded, forward, backward, ``clip_grad_norm_`` (not under the pipeline's schedule, which has no global norm),
the same AdamW, ``zero_grad``; nothing read back. Layouts (all on ``--nproc`` 2 gloo ranks unless one):

    one (1 rank)   ours vs a plain loop            tp      tensor parallel vs DTensor parallelize_module
    one_bf16       the same in bf16 autocast        tp_sp   with sequence parallelism (+ SequenceParallel)
    one_dropout    model.dropout 0.1 (ours: Philox  pp      1F1B, 4 micro-batches vs torch.distributed.pipelining
                   keyed masks; torch's RNG)                Schedule1F1B (no clip)
    one_dropout_device_plan   the same, our masks drawn as a GPU draws them (whole tensor, one pass)
    ddp            DataParallel vs DistributedDataParallel
    zero2 / zero3  ZeRO-2 / ZeRO-3 vs fully_shard(reshard_after_forward=False / True), every block and the root
    cp, ep, ep_padded, ps   ours alone: ring attention; experts over ep 2 (counts exchanged / padded to capacity
                   model.moe_capacity_factor 1); the parameter server (1 server, 2 workers, bsp)

and the dropout sites alone: the operators of one attention-probability site and one residual site at B 8, H 32,
T 4096, d 4096 built on the meta device with the plan of a device that is not a CPU (one pass), and the CPU's
plan (passes of 32K Philox calls: the plan every device used before) counted at three small shapes, its growth
law fitted on them and evaluated at the real shape.

    python bench/bench_dispatch.py                    # every layout (CPU, gloo), writes bench/results/dispatch.json
    python bench/bench_dispatch.py --layouts one ddp --json /tmp/d.json
    python bench/bench_dispatch.py --device cuda      # on a GPU: the one-process layouts, with real CUDA tensors

On a CPU ``one_dropout`` draws the CPU's masks (passes of 32K calls, a causal mask's ``nonzero``: free on a CPU,
counted by the simulation); a GPU draws the whole-tensor plan (see the dropout sites). Operator and
synchronisation counts are deterministic (the same on an idle or a loaded machine); the times are
not, and the counter's own Python (~10 us per operator) is in both sides' Python time. On a CPU the counter
simulates a device (tensors made on the host are host tensors, the rest device tensors): a read of a device
tensor is counted as the synchronisation it is on a GPU. Ratios are ours / torch's, summed over the ranks.
Targets (issue 35): operators <= 1.1x torch's; no synchronisation in the dense steps in bf16 / fp32; at most one
per MoE layer with experts (none padded).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BENCH = Path(__file__).resolve().parent
if str(BENCH.parent / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(BENCH.parent / "src"))
sys.path.insert(0, str(BENCH))
from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

RESULTS = BENCH / "results" / "dispatch.json"
DENSE = {"model.preset": "tiny-llama"}
MOE = {"model.preset": "tiny-moe"}
LAYOUTS: dict[str, tuple[int, dict, str | None]] = {
    "one": (1, {**DENSE}, "plain"),
    "one_bf16": (1, {**DENSE, "train.precision": "bf16"}, "plain"),
    "one_dropout": (1, {**DENSE, "model.dropout": 0.1}, "plain"),
    "one_dropout_device_plan": (1, {**DENSE, "model.dropout": 0.1}, "plain"),
    "ddp": (2, {**DENSE}, "ddp"),
    "zero2": (2, {**DENSE, "parallel.zero": 2}, "fsdp_keep"),
    "zero3": (2, {**DENSE, "parallel.zero": 3}, "fsdp"),
    "tp": (2, {**DENSE, "parallel.tp": 2}, "tp"),
    "tp_sp": (2, {**DENSE, "parallel.tp": 2, "parallel.sequence_parallel": True}, "tp_sp"),
    "pp": (2, {**DENSE, "parallel.pp": 2, "parallel.pp_schedule": "1f1b", "parallel.microbatches": 4}, "pp"),
    "cp": (2, {**DENSE, "parallel.cp": 2}, None),
    "ep": (2, {**MOE, "parallel.ep": 2}, None),
    "ep_padded": (2, {**MOE, "parallel.ep": 2, "model.moe_capacity_factor": 1.0, "parallel.ep_dispatch": "padded"},
                  None),
    "ps": (3, {**DENSE, "ps.servers": 1}, None),
}
"""layout -> (processes, our config overrides, torch's peer or None)."""
DEVICE_PLAN = ("one_dropout_device_plan",)
"""Layouts whose masks are drawn with the plan of a device that is not a CPU (the whole tensor in one pass, no
``nonzero``) wherever they run: what a GPU dispatches, counted on a CPU."""
ONE_GPU = ("one", "one_bf16", "one_dropout")
"""The layouts one GPU holds (NCCL: one rank per GPU)."""


def config(layout: str, args, run_dir: Path):
    """The resolved config of our run of ``layout``: ``--micro-batch`` sequences per data-parallel rank (the
    pipeline's global batch is its micro-batches'), ``--warmup + 4`` steps (the run stops two before the end:
    no final evaluation or checkpoint)."""
    from shardwise.config import Config
    from shardwise.launch import prepare_run

    nproc, overrides, _ = LAYOUTS[layout]
    workers = nproc - overrides.get("ps.servers", 0)
    model_parallel = overrides.get("parallel.tp", 1) * overrides.get("parallel.pp", 1) * overrides.get("parallel.cp", 1)
    dp = workers // model_parallel
    batch = args.micro_batch * (overrides.get("parallel.microbatches", 1)) * dp
    base = {"data.source": "stdlib", "data.max_bytes": 200_000, "data.cache_dir": args.cache_dir,
            "data.seq_len": args.seq_len, "model.max_seq_len": args.seq_len, "train.steps": args.warmup + 4,
            "train.global_batch": batch, "train.warmup_steps": 1, "train.eval_every": 0, "train.eval_batches": 1,
            "train.precision": "fp32", "parallel.nproc": nproc, "run.device": args.device, "ckpt.every": 0,
            "run.dir": str(run_dir), "run.progress": False, "run.tensorboard": False}
    if args.device == "cuda":
        base["parallel.backend"] = "nccl"
    merged = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in {**base, **overrides}.items()}
    cfg, _ = prepare_run(Config.load(overrides=merged))
    return cfg


def run_ours(cfg, args):
    from shardwise.dispatch_count import CallWindow, optimizer_steps
    from shardwise.ps.worker import Worker
    from shardwise.train.engine import Engine
    from shardwise.worker import train

    def host_steps(obj, counter):  # the optimizer's step counts live on the CPU
        counter.on_host(optimizer_steps(getattr(obj, "optimizer", None)))

    cls, method = (Worker, "step") if cfg.ps.servers else (Engine, "forward_backward")
    window = CallWindow(cls, method, args.warmup, args.device, on_open=host_steps)
    try:
        train(cfg, Path(cfg.run.dir), stop_after=cfg.train.steps - 2)
    finally:
        counts = window.close()
    return counts


def peer_model(cfg, kind: str, device: torch.device):
    """torch's own layout ``kind`` over the same Transformer: ``(step(x, y), optimizer)``."""
    from torch import nn

    from shardwise.model import Transformer
    from shardwise.train.optim import build_optimizer

    torch.manual_seed(cfg.train.seed)
    if kind == "pp":
        return _peer_pipeline(cfg, device)
    model = Transformer(cfg.model)
    model.reset_parameters(cfg.train.seed)
    model.to(device)
    named = list(model.named_parameters())
    loss_context = None
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind in ("fsdp", "fsdp_keep"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=kind == "fsdp")
        fully_shard(model, reshard_after_forward=kind == "fsdp")
        named = list(model.named_parameters())
    elif kind in ("tp", "tp_sp"):
        import bench_tp
        from torch.distributed.tensor.parallel import loss_parallel

        bench_tp.torch_tp(model, kind == "tp_sp")
        named = list(model.named_parameters())
        loss_context = loss_parallel
    optimizer = build_optimizer(model, cfg.train, named)
    params = [p for _, p in named]
    autocast = cfg.train.precision == "bf16"

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if loss_context is None:
                loss = model(x, y)
                loss.backward()
            else:
                with loss_context():
                    loss = model(x, y)
                    loss.backward()
        if cfg.train.grad_clip and kind not in ("tp", "tp_sp"):  # DTensor TP: its unsharded norms are plain tensors
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def _peer_pipeline(cfg, device: torch.device):
    import bench_pipeline
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from shardwise.parallel.pipeline.partition import build_stage, partition
    from shardwise.train.optim import build_optimizer

    p = cfg.parallel
    rank, n = dist.get_rank(), p.pp
    split = partition(cfg.model, n, "even")
    module = bench_pipeline._Logits(build_stage(cfg.model, rank, n, split[rank], cfg.train.seed)).to(device)
    stage = PipelineStage(module, rank, n, device)
    schedule = Schedule1F1B(stage, p.microbatches, loss_fn=bench_pipeline._loss)
    named = [(k.removeprefix("stage."), v) for k, v in module.named_parameters()]
    optimizer = build_optimizer(nn.ModuleList([module]), cfg.train, named)

    def step(x, y):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def run_peer(cfg, kind: str, args):
    from shardwise.dispatch_count import DispatchCounter, optimizer_steps

    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    step, optimizer = peer_model(cfg, kind, device)
    dp = 1 if kind in ("tp", "tp_sp", "pp") else dist.get_world_size()
    rows = cfg.train.global_batch // dp
    g = torch.Generator().manual_seed(dist.get_rank() if dp > 1 else 0)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.warmup + 1, rows, cfg.data.seq_len + 1), generator=g)
    counter = DispatchCounter(args.device)
    for i in range(args.warmup + 1):
        if i == args.warmup:
            counter.start()
            counter.on_host(optimizer_steps(optimizer))
        batch = tokens[i].to(device)
        step(batch[:, :-1], batch[:, 1:])
    return counter.stop()


def _summary(counts) -> dict | None:
    return None if counts is None else counts.to_dict()


def _worker(rank: int, nproc: int, port: int, layout: str, cfg, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if layout in DEVICE_PLAN:
        from shardwise.model.dropout import MaskPlan

        MaskPlan.for_device = classmethod(lambda cls, device: cls(None, False))
    try:
        out = {"ours": _summary(run_ours(cfg, args))}
        kind = LAYOUTS[layout][2]
        if kind is not None:
            out["torch"] = _summary(run_peer(cfg, kind, args))
        queue.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported by the parent with the rank
        import traceback

        queue.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}))
    finally:
        from shardwise.dist import shutdown_distributed

        shutdown_distributed()


def run_layout(layout: str, args, work: Path) -> dict:
    from shardwise.dist import free_port

    nproc = LAYOUTS[layout][0]
    cfg = config(layout, args, work / layout)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, layout, cfg, args, queue)) for r in range(nproc)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, out = queue.get(timeout=args.timeout)
        got[rank] = out
    for p in procs:
        p.join(timeout=60)
    errors = {r: o["error"] for r, o in got.items() if "error" in o}
    if errors:
        raise RuntimeError(f"layout {layout}: " + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return {"nproc": nproc, "overrides": LAYOUTS[layout][1], "peer": LAYOUTS[layout][2],
            **{side: _combine([got[r][side] for r in sorted(got)]) for side in ("ours", "torch") if side in got[0]}}


def _combine(per_rank: list[dict | None]) -> dict:
    """The ranks' counts summed (syncs by site: every rank's, by rank), and each rank's own."""
    ranks = [r for r in per_rank if r is not None]  # a parameter server rank runs no training step
    total = {k: sum(r[k] for r in ranks) for k in ("ops", "device_ops", "kernels", "syncs", "collectives",
                                                   "collective_bytes")}
    total.update({k: max(r[k] for r in ranks) for k in ("wall_s", "op_s", "python_s")})
    kinds: dict[str, int] = {}
    for r in ranks:
        for kind, n in r["syncs_by_kind"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    total["syncs_by_kind"] = kinds
    total["syncs_by_site"] = {f"rank {i}": r["syncs_by_site"] for i, r in enumerate(per_rank)
                              if r is not None and r["syncs_by_site"]}
    total["per_rank"] = per_rank
    return total


RATIO_KEYS = ("ops", "kernels", "syncs", "collectives", "collective_bytes", "python_s")


def ratios(row: dict) -> dict:
    if "torch" not in row:
        return {}
    return {k: (row["ours"][k] / row["torch"][k] if row["torch"][k] else (math.inf if row["ours"][k] else 1.0))
            for k in RATIO_KEYS}


# ---- dropout sites -------------------------------------------------------------------------------------------------


def dropout_sites() -> dict:
    """Operators of one attention-probability site (B 8, H 32, T 4096, causal) and one residual site (B 8, T 4096,
    d 4096): the device plan built on the meta device; the CPU plan (the one every device used before) counted
    at three shapes, ops = a + b * passes fitted on the first two, checked on the third, evaluated at the real one."""
    from shardwise.dispatch_count import DispatchCounter
    from shardwise.model.dropout import CHUNK, LANES, Dropout, DropoutKey, MaskPlan, keep_mask

    key = DropoutKey(1, 2, 0)

    def count(fn, device: str) -> dict:
        with DispatchCounter(device) as c:
            fn()
        return {"ops": c.counts.ops, "kernels": c.counts.kernels, "syncs": c.counts.n_syncs}

    def attention(b: int, h: int, t: int, device: str, plan=None):
        pos = torch.arange(t, device=device)
        index = [torch.arange(b, device=device), torch.arange(h, device=device), pos, pos]
        return lambda: keep_mask(0.1, key, 0, "attn_probs", index, [h, t, t], True, aligned=t % LANES == 0, plan=plan)

    def residual(b: int, t: int, d: int, device: str):
        module = Dropout(0.1, "mlp_out", 0).train()
        x = torch.empty(b, t, d, device=device)
        return lambda: module(x, key)

    def causal_calls(b: int, h: int, t: int) -> int:  # Philox calls a causal mask reads: key blocks up to the query
        return b * h * sum(q // LANES + 1 for q in range(t))

    real = (8, 32, 4096)
    out = {"shape": {"B": 8, "H": 32, "T": 4096, "d": 4096},
           "device_plan": {"attn_probs": count(attention(*real, "meta"), "meta"),
                           "residual": count(residual(8, 4096, 4096, "meta"), "meta")}}
    shapes = [(1, 2, 512), (1, 4, 1024), (2, 4, 1024)]
    cpu = []
    for b, h, t in shapes:
        passes = math.ceil(causal_calls(b, h, t) / CHUNK)
        cpu.append({"shape": [b, h, t], "passes": passes, **count(attention(b, h, t, "cpu", MaskPlan(CHUNK, True)),
                                                                   "cpu")})
    slope, intercept = _law(cpu)
    passes = math.ceil(causal_calls(*real) / CHUNK)
    res = []
    for b, t, d in [(8, 1024, 64), (8, 2048, 64), (16, 2048, 64)]:
        res.append({"shape": [b, t, d], "passes": math.ceil(b * t * d / LANES / CHUNK),
                    **count(residual(b, t, d, "cpu"), "cpu")})
    r_slope, r_intercept = _law(res)
    r_passes = math.ceil(8 * 4096 * 4096 / LANES / CHUNK)
    out["cpu_plan"] = {"counted": cpu, "law": f"ops = {intercept:.0f} + {slope:.1f} x passes (32K Philox calls each)",
                       "law_checked_on_third": intercept + slope * cpu[2]["passes"] == cpu[2]["ops"],
                       "attn_probs_at_shape": {"passes": passes, "ops": round(intercept + slope * passes)},
                       "residual_counted": res, "residual_law": f"ops = {r_intercept:.0f} + {r_slope:.1f} x passes",
                       "residual_law_checked_on_third": r_intercept + r_slope * res[2]["passes"] == res[2]["ops"],
                       "residual_at_shape": {"passes": r_passes, "ops": round(r_intercept + r_slope * r_passes)},
                       "syncs_before": "2 per attention site (the alignment check's bool(), the causal nonzero), "
                                       "1 per residual site (the alignment check)"}
    return out


def _law(rows: list[dict]) -> tuple[float, float]:
    """``(slope, intercept)`` of ops against passes through the first two rows."""
    slope = (rows[1]["ops"] - rows[0]["ops"]) / (rows[1]["passes"] - rows[0]["passes"])
    return slope, rows[0]["ops"] - slope * rows[0]["passes"]


# ---- report --------------------------------------------------------------------------------------------------------


def print_table(result: dict) -> None:
    print(f"{'layout':12s} {'ops ours':>9s} {'torch':>7s} {'ratio':>6s} {'kern.':>6s} {'syncs':>9s} "
          f"{'coll.':>9s} {'MB':>11s} {'python s':>15s}")
    for name, row in result["layouts"].items():
        o, t, r = row["ours"], row.get("torch"), row.get("ratios", {})

        def pair(k, fmt="{}", o=o, t=t):
            return f"{fmt.format(o[k])}/{fmt.format(t[k])}" if t else fmt.format(o[k])
        print(f"{name:12s} {o['ops']:9d} {t['ops'] if t else '-':>7} {r.get('ops', float('nan')):6.2f} "
              f"{r.get('kernels', float('nan')):6.2f} {pair('syncs'):>9s} {pair('collectives'):>9s} "
              f"{pair('collective_bytes', '{:.0f}'):>11s} {pair('python_s', '{:.3f}'):>15s}")
        for rank, sites in o["syncs_by_site"].items():
            for site, kinds in sites.items():
                print(f"{'':12s}   ours {rank}: {site} {kinds}")
    d = result.get("dropout_sites")
    if d:
        print(f"dropout at B8 H32 T4096: attention site {d['device_plan']['attn_probs']['ops']} ops (device plan) vs "
              f"{d['cpu_plan']['attn_probs_at_shape']['ops']} (CPU plan, {d['cpu_plan']['law']}); residual site "
              f"{d['device_plan']['residual']['ops']} ops vs {d['cpu_plan']['residual_at_shape']['ops']}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None,
                    help="default: every layout (on --device cuda: the one-process ones)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the one counted")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per data-parallel rank and micro-batch")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--no-dropout-sites", action="store_true", help="skip the dropout sites' counts")
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a layout's processes may take")
    ap.add_argument("--json", type=Path, default=RESULTS)
    add_machine_note(ap)
    args = ap.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/bench_dispatch.py --device cuda needs a CUDA GPU, but torch.cuda.is_available() is False; run "
              "it on a GPU machine, or with --device cpu", file=sys.stderr)
        raise SystemExit(2)
    layouts = args.layouts or (list(ONE_GPU) if args.device == "cuda" else list(LAYOUTS))
    if args.device == "cuda" and (many := [name for name in layouts if LAYOUTS[name][0] > 1]):
        print(f"bench/bench_dispatch.py --device cuda: {', '.join(many)} need(s) several NCCL ranks, one GPU each; "
              f"use {', '.join(ONE_GPU)}", file=sys.stderr)
        raise SystemExit(2)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {"benchmark": "dispatch", "date": now,
              "machine": platform.node(), "device": torch.cuda.get_device_name() if args.device == "cuda" else
              platform.processor() or "cpu", "torch": torch.__version__,
              "command": " ".join(["python", "bench/bench_dispatch.py", *(sys.argv[1:] if argv is None else argv)]),
              "counted_on": args.device, "warmup": args.warmup, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-dispatch-") as tmp:
        if not args.cache_dir:
            args.cache_dir = str(Path(tmp) / "cache")
        for name in layouts:
            row = run_layout(name, args, Path(tmp))
            row["ratios"] = ratios(row)
            result["layouts"][name] = row
            print(f"{name}: done", flush=True)
    if not args.no_dropout_sites:
        result["dropout_sites"] = dropout_sites()
    print_table(result)
    bench_run.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
