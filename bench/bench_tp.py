"""Benchmark: our tensor (and sequence) parallelism against torch's DTensor tensor parallelism, side by side.

The same Llama-flavour Transformer (shardwise.model, RMSNorm / SwiGLU / GQA) is split the same way by
both: q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel, the token embedding over
the vocabulary, lm_head over the vocabulary with a vocabulary-parallel cross-entropy. Ours is
``shardwise.parallel.tensor.plan.apply_tensor_parallel``; the peer is ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` (and ``SequenceParallel`` + ``PrepareModuleInput`` with
``--sp``), the loss under ``loss_parallel()`` -- the layout torchtitan uses for Llama.

Both run in the *same* worker processes, from the same initial weights and batches; after a warm-up
the timed steps (forward + backward + AdamW) alternate between them, the one going first rotating.
The report: the median step time of each (slowest rank), their ratio ours/torch and the median of the
per-step ratios; the bytes autograd saved for backward in one step (activation memory, counted by a
``saved_tensors_hooks`` pack hook, each storage once) and their ratio; peak RSS from separate
single-variant runs (a process's high-water mark cannot be split) and its ratio; the largest
difference between the two runs' losses (a check that both trained the same model).

    python bench/bench_tp.py --nproc 2 --steps 20          # TP
    python bench/bench_tp.py --nproc 2 --steps 20 --sp     # TP + sequence parallelism
    python bench/bench_tp.py --nproc 2 --steps 20 --dropout 0.1 [--sp]

Results go to bench/results/tp.json (tp_sp.json with --sp; ``_dropout`` before ``.json`` with --dropout). gloo
on CPU.

With ``--dropout P`` both sides drop embeddings, residual branches and attention probabilities with
probability P. Ours draws every mask from the counter-based generator keyed by each element's global index
(``shardwise.model.dropout``: the masks one process draws, whatever the layout; attention through the eager
core that applies a given mask). The peer is torch's own dropout (``F.dropout``, and
``scaled_dot_product_attention(dropout_p=P)``, whose CPU kernel then takes its math path) on DTensors: its
RNG tracker (``OffsetBasedRNGTracker``) exists for CUDA-like devices only, so on this CPU each rank draws from
its own generator (the report says so). The two sides draw different masks, so their losses differ by more
than rounding.
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

from shardwise.bench_result import BenchRun, add_machine_note
from shardwise.dist import free_port, shutdown_distributed

RESULTS = Path(__file__).resolve().parent / "results"


def build_model(args):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer

    overrides = {"model.preset": "tiny-llama", "model.d_model": str(args.d_model), "model.n_layers": str(args.n_layers),
                 "model.n_heads": str(args.n_heads), "model.n_kv_heads": str(args.n_kv_heads),
                 "model.vocab_size": str(args.vocab), "model.max_seq_len": str(args.seq_len),
                 "data.seq_len": str(args.seq_len), "model.dropout": str(args.dropout)}
    cfg = resolve(Config.load(overrides=overrides), tokenizer_vocab=args.vocab).model
    model = Transformer(cfg)
    model.reset_parameters(0)
    desc = {"name": "shardwise.model.Transformer", "flavor": cfg.flavor, "d_model": cfg.d_model,
            "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "d_ff": cfg.d_ff,
            "vocab_size": cfg.vocab_size, "parameters": model.num_parameters()}
    return model, desc


def torch_tp(model, sp: bool):
    """The peer: torch DTensor TP on the same module paths (torchtitan's Llama layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = Shard(1) if sp else Replicate()
    top = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=out),
        "lm_head": ColwiseParallel(input_layouts=out, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top["norm_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.blocks:
        layout = {f"attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        layout.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                       "attn.o_proj": RowwiseParallel(output_layouts=out),
                       "mlp.down_proj": RowwiseParallel(output_layouts=out)})
        if sp:
            into = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            layout.update({"norm1": SequenceParallel(), "norm2": SequenceParallel(), "attn": into, "mlp": into})
        parallelize_module(block, mesh, layout)
    return model


def ours_tp(model, sp: bool, args=None):
    from shardwise.parallel.tensor.plan import apply_tensor_parallel

    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
    if args is not None and args.dropout:  # the tokens and heads this rank holds, as the engine's parallelize says
        from shardwise.parallel.dropout import attention_heads, place_slices, stream_tokens

        tp, rank = dist.get_world_size(), dist.get_rank()
        place_slices(model, stream_tokens(args.seq_len, tp=tp, tp_rank=rank, sequence_parallel=True) if sp else None,
             attention_heads(args.n_heads, tp, rank))
    return model


def _batch(args, step: int):
    g = torch.Generator().manual_seed(step)  # every tp rank reads the same sequences
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while active."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t):
        local = t
        for attr in ("_local_tensor", "elem"):  # a DTensor's local shard; an async-collective wrapper's tensor
            local = getattr(local, attr, local)
        try:
            s = local.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
        except RuntimeError:  # a wrapper without a storage of its own: count its elements
            self.storages[id(local)] = local.numel() * local.element_size()
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _loss(kind: str, model, x, y, step: int, dropout: float):
    if kind == "torch":
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = model(x, y)
            loss.backward()
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    if dropout:
        from shardwise.model.dropout import DropoutKey

        loss = model(x, y, dropout_key=DropoutKey(seed=0, step=step))
    else:
        loss = model(x, y)
    loss.backward()
    return loss


def _step(kind, model, opt, args, step: int, saved: _SavedBytes | None = None) -> tuple[float, float]:
    x, y = _batch(args, step)
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    if saved is not None:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = _loss(kind, model, x, y, step, args.dropout)
    else:
        loss = _loss(kind, model, x, y, step, args.dropout)
    opt.step()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), loss.item()


def _worker(rank: int, args, port: int, mode: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from shardwise.dist import init_distributed

    init_distributed("gloo", timeout_s=600)
    base, desc = build_model(args)
    kinds = ["ours", "torch"] if mode == "time" else [mode]
    nets, opts = {}, {}
    for kind in kinds:
        model = copy.deepcopy(base)
        nets[kind] = ours_tp(model, args.sp, args) if kind == "ours" else torch_tp(model, args.sp)
        opts[kind] = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    del base
    times = {k: [] for k in kinds}
    losses = {k: [] for k in kinds}
    saved = {}
    steps = args.warmup + (args.steps if mode == "time" else args.memory_steps)
    for step in range(steps):
        order = kinds[step % len(kinds):] + kinds[:step % len(kinds)]
        for kind in order:
            probe = _SavedBytes() if step == 0 else None
            seconds, loss = _step(kind, nets[kind], opts[kind], args, step, probe)
            if probe is not None:
                saved[kind] = probe.total
            losses[kind].append(loss)
            if step >= args.warmup:
                times[kind].append(seconds)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)  # ru_maxrss is in KiB on Linux
    if rank == 0:
        queue.put({"model": desc, "times": times, "losses": losses, "saved_bytes": saved, "peak_rss_mb": rss.item()})
    shutdown_distributed()


def _launch(args, mode: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, free_port(), mode, queue), nprocs=args.nproc, start_method="spawn")
    return queue.get()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="worker processes = tp")
    p.add_argument("--sp", action="store_true", help="sequence parallelism on both sides")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (divisible by nproc: the same split both sides)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per step (every tp rank holds all of them)")
    p.add_argument("--dropout", type=float, default=0.0, help="model.dropout on both sides (see the docstring)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="intra-op threads per rank")
    p.add_argument("--memory-steps", type=int, default=2, help="steps of each single-variant memory run (0: skip)")
    p.add_argument("--json", default=None, help="where to write the results (default bench/results/tp[_sp].json)")
    add_machine_note(p)
    args = p.parse_args(argv)
    stem = ("tp_sp" if args.sp else "tp") + ("_dropout" if args.dropout else "")
    out = Path(args.json) if args.json else RESULTS / f"{stem}.json"
    bench_run = BenchRun.start(__file__, argv, args, output=out)
    if args.threads * args.nproc > (os.cpu_count() or 1):
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc)
    if args.vocab % args.nproc:
        p.error(f"--vocab={args.vocab} does not divide by --nproc={args.nproc}")

    run = _launch(args, "time")
    times = run["times"]
    ours, ref = statistics.median(times["ours"]), statistics.median(times["torch"])
    paired = statistics.median(a / b for a, b in zip(times["ours"], times["torch"], strict=True))
    loss_gap = max(abs(a - b) for a, b in zip(run["losses"]["ours"], run["losses"]["torch"], strict=True))
    result = {
        "benchmark": "tensor parallel" + (" + sequence parallel" if args.sp else "")
                     + ": shardwise apply_tensor_parallel vs torch DTensor parallelize_module",
        "torch": torch.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "backend": "gloo", "tp": args.nproc, "sequence_parallel": args.sp, "threads_per_rank": args.threads,
        "batch": args.batch, "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps,
        "dropout": args.dropout,
        "peer_dropout_rng": ("torch's per-rank CPU generator (DTensor's OffsetBasedRNGTracker needs a CUDA-like device)"
                             if args.dropout else None),
        "model": run["model"],
        "ours": {"step_s_median": ours, "step_s": times["ours"], "saved_bytes": run["saved_bytes"]["ours"]},
        "torch_dtensor": {"step_s_median": ref, "step_s": times["torch"], "saved_bytes": run["saved_bytes"]["torch"]},
        "ratio_step_time": ours / ref,
        "ratio_step_time_paired_median": paired,
        "ratio_saved_bytes": run["saved_bytes"]["ours"] / run["saved_bytes"]["torch"],
        "max_loss_difference": loss_gap,
        "losses": run["losses"],
    }
    if args.memory_steps:
        for kind, key in (("ours", "ours"), ("torch", "torch_dtensor")):
            result[key]["peak_rss_mb"] = _launch(args, kind)["peak_rss_mb"]
        result["ratio_peak_rss"] = result["ours"]["peak_rss_mb"] / result["torch_dtensor"]["peak_rss_mb"]
    bench_run.write(out, result)
    _print_table(result, out)
    return result


def _print_table(r: dict, out: Path) -> None:
    m = r["model"]
    print(f"{m['name']} {m['flavor']} ({m['parameters'] / 1e6:.1f}M params), tp {r['tp']}"
          f"{' + SP' if r['sequence_parallel'] else ''} x {r['threads_per_rank']} thread(s), gloo, "
          f"batch {r['batch']}x{r['seq_len']}" + (f", dropout {r['dropout']}" if r.get("dropout") else ""))
    print(f"{'':26}{'step (median s)':>16}{'saved (MiB)':>14}{'peak RSS (MiB)':>16}")
    for label, key in (("shardwise TP", "ours"), ("torch DTensor TP", "torch_dtensor")):
        v = r[key]
        rss = f"{v['peak_rss_mb']:.0f}" if v.get("peak_rss_mb") else "-"
        print(f"{label:26}{v['step_s_median']:>16.4f}{v['saved_bytes'] / 2**20:>14.1f}{rss:>16}")
    line = (f"ratio ours/torch: step time {r['ratio_step_time']:.3f} (median of per-step ratios "
            f"{r['ratio_step_time_paired_median']:.3f}), saved activations {r['ratio_saved_bytes']:.3f}")
    if "ratio_peak_rss" in r:
        line += f", peak RSS {r['ratio_peak_rss']:.3f}"
    print(line + f"; max loss difference {r['max_loss_difference']:.2e}; written to {out}")


if __name__ == "__main__":
    main()
