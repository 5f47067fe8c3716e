"""Benchmark: context parallelism as the sequence grows -- activation memory and step time per rank at
cp = 1, 2, 4, and ours beside torch's experimental ``context_parallel`` where it runs.

For each sequence length and cp, ``cp`` gloo workers build the same Llama-flavour Transformer
(shardwise.model; GQA, rotary positions), apply ``shardwise.parallel.context.apply_context_parallel``
(cp > 1) and train a few steps (forward + backward + AdamW) on this rank's head-tail share of each
sequence. Measured per rank, reported for the busiest one:

* activation memory: the bytes autograd saved for backward in one step (each storage once, counted by a
  ``saved_tensors_hooks`` pack hook -- bench_tp.py's probe -- parameters left out); target: falls as 1/cp;
* median step time (slowest rank), the bytes handed to the cp axis per step (the counting layer) and the
  attention work balance: counted (``cp_attn_tile_imbalance``, 1.0 with head-tail) and measured by the clock
  around the blocks (``cp_attn_time_imbalance``).

The peer: ``torch.distributed.tensor.experimental.context_parallel`` on the same model and batch (its
ring attention dispatches torch's fused SDPA kernels); when it raises on this backend the error is
recorded and reported as "does not run".

    python bench/bench_cp.py --seq-lens 512,1024,2048,4096,8192 --cps 1,2,4 --steps 3

Results go to bench/results/cp.json and bench/results/cp.png. gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
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
from bench_tp import _SavedBytes  # noqa: E402  (the same activation probe)

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402
from shardwise.dist import free_port, shutdown_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class _Activations(_SavedBytes):
    """bench_tp's probe without the parameters (a Linear saves its weight for backward: a model state, not
    an activation), so that what is counted is the activation memory that context parallelism divides."""

    def __init__(self, model):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    @property
    def total(self) -> int:
        return sum(n for ptr, n in self.storages.items() if ptr not in self.params)


def _config(args, cp: int, seq: int):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve

    overrides = {"model.preset": "tiny-llama", "model.d_model": str(args.d_model), "model.n_layers": str(args.n_layers),
                 "model.n_heads": str(args.n_heads), "model.n_kv_heads": str(args.n_kv_heads),
                 "model.vocab_size": str(args.vocab), "model.max_seq_len": str(seq), "data.seq_len": str(seq),
                 "parallel.nproc": str(cp), "parallel.cp": str(cp), "parallel.backend": "gloo",
                 "train.global_batch": str(args.batch)}
    if cp > 1:
        overrides["parallel.cp_algorithm"] = args.algorithm
    return resolve(Config.load(overrides=overrides), world_size=cp, tokenizer_vocab=args.vocab)


def _step(model, opt, x, y, probe=None) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    if probe is not None:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack):
            loss = model(x, y)
    else:
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _max(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _torch_peer(cfg, mesh, x, y, args) -> dict:
    """torch's experimental context parallelism on the same model and full batch (it shards the buffers)."""
    from torch.distributed.tensor.experimental import context_parallel

    from shardwise.model import Transformer

    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cp_mesh = mesh.device_mesh["cp"]
    times, probe = [], _Activations(model)
    try:
        for step in range(args.warmup + args.steps):
            xs, ys = x.clone(), y.clone()
            with context_parallel(cp_mesh, buffers=[xs, ys], buffer_seq_dims=[1, 1]):
                seconds = _step(model, opt, xs, ys, probe if step == 0 else None)
            if step >= args.warmup:
                times.append(seconds)
    except Exception as e:  # noqa: BLE001 - the peer may not support this backend: record why
        return {"runs": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"runs": True, "step_s_median": statistics.median(times), "saved_bytes_max": _max(probe.total)}


def _worker(rank: int, args, port: int, cp: int, seq: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from shardwise.dist import init_distributed
    from shardwise.dist.comm.counting import CommLedger
    from shardwise.dist.mesh import ParallelDims
    from shardwise.model import Transformer
    from shardwise.parallel.context import SequenceLayout, apply_context_parallel, pop_attention_work

    init_distributed("gloo", timeout_s=600)
    cfg = _config(args, cp, seq)
    mesh = ParallelDims(cp=cp).build("cpu")
    model = Transformer(cfg.model)
    model.reset_parameters(0)
    ledger = CommLedger()
    if cp > 1:
        apply_context_parallel(model, mesh, cfg, ledger["cp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)  # every cp rank reads the same sequences
    tokens = torch.randint(0, args.vocab, (args.batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    layout = SequenceLayout(cp, mesh.rank("cp"), cfg.parallel.cp_balance)
    xl, yl = (layout.shard(x), layout.shard(y)) if cp > 1 else (x, y)
    times, probe, work = [], _Activations(model), {}
    for step in range(args.warmup + args.steps):
        seconds = _step(model, opt, xl, yl, probe if step == 0 else None)
        work = pop_attention_work(model)()  # its reader, called at once (every cp rank, at the same point)
        sent = ledger.pop_metrics().get("cp_sent_bytes", 0.0)
        if step >= args.warmup:
            times.append(seconds)
    result = {"cp": cp, "seq_len": seq, "step_s_median": statistics.median(times), "step_s": times,
              "saved_bytes_max": _max(probe.total), "cp_sent_bytes_max": _max(sent),
              "cp_attn_tile_imbalance": work.get("cp_attn_tile_imbalance", 1.0),
              "cp_attn_time_imbalance": work.get("cp_attn_time_imbalance", 1.0)}
    if cp > 1 and args.peer:
        result["torch_context_parallel"] = _torch_peer(cfg, mesh, x, y, args)
    if rank == 0:
        queue.put(result)
    shutdown_distributed()


def _launch(args, cp: int, seq: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, free_port(), cp, seq, queue), nprocs=cp, start_method="spawn")
    return queue.get()


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 4))
    for cp in sorted({r["cp"] for r in rows}):
        mine = [r for r in rows if r["cp"] == cp]
        seqs = [r["seq_len"] for r in mine]
        mem.plot(seqs, [r["saved_bytes_max"] / 2**20 for r in mine], marker="o", label=f"cp={cp}")
        step.plot(seqs, [r["step_s_median"] for r in mine], marker="o", label=f"cp={cp}")
    for ax, title in ((mem, "activations saved for backward, busiest rank (MiB)"), (step, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(title, fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="512,1024,2048,4096,8192")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--algorithm", default="ring", choices=("ring", "allgather", "ulysses"))
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip torch's context_parallel")
    p.add_argument("--json", default=None, help="default bench/results/cp.json (plot beside it)")
    add_machine_note(p)
    args = p.parse_args(argv)
    out = Path(args.json) if args.json else RESULTS / "cp.json"
    bench_run = BenchRun.start(__file__, argv, args, output=out)
    rows = []
    for seq in (int(s) for s in args.seq_lens.split(",")):
        for cp in (int(c) for c in args.cps.split(",")):
            rows.append(_launch(args, cp, seq))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "step_s"}), flush=True)
    base = {r["seq_len"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        if r["seq_len"] in base:
            r["memory_vs_cp1_times_cp"] = r["saved_bytes_max"] * r["cp"] / base[r["seq_len"]]["saved_bytes_max"]
    result = {"benchmark": f"context parallel ({args.algorithm}, head-tail) vs cp=1 and torch context_parallel",
              "torch": torch.__version__,
              "platform": platform.platform(), "cpu_count": os.cpu_count(), "backend": "gloo",
              "threads_per_rank": args.threads, "model": {k: getattr(args, k) for k in
                                                          ("d_model", "n_layers", "n_heads", "n_kv_heads", "vocab")},
              "batch": args.batch, "rows": rows}
    bench_run.write(out, result)
    _plot(rows, out.with_suffix(".png"))
    print(f"{'seq':>6} {'cp':>3} {'act MiB':>9} {'x cp / cp1':>10} {'step s':>8} {'cp MiB/step':>11} {'torch cp':>10}")
    for r in rows:
        peer = r.get("torch_context_parallel")
        peer_s = "-" if peer is None else (f"{peer['step_s_median']:.3f}s" if peer["runs"] else "fails")
        print(f"{r['seq_len']:>6} {r['cp']:>3} {r['saved_bytes_max'] / 2**20:>9.2f} "
              f"{r.get('memory_vs_cp1_times_cp', float('nan')):>10.3f} {r['step_s_median']:>8.3f} "
              f"{r['cp_sent_bytes_max'] / 2**20:>11.2f} {peer_s:>10}")
    return result


if __name__ == "__main__":
    main()
