"""Where the MoE step's extra time goes: one training step (forward under bf16 autocast, loss, backward,
AdamW) of the default model (``cpu-demo``) against the same model with 64 experts top-8 of width 128 (equal
active FLOPs, ``bench_moe_step.py``'s pair), profiled by ``torch.profiler`` in one process, and the time of one
64-expert map (256 -> 128, 16,384 rows, forward + backward) in each expert kernel next to the dense matmul of
the same FLOPs.

    python bench/profile_moe_step.py --threads 1            # --json PATH to keep the figures

Per step (milliseconds, the mean of 3 profiled steps after 3 warm-up ones): the step, the experts' grouped
GEMM (``aten::_grouped_mm`` with what it calls), AdamW, the casts (``aten::copy_``), the gathers and scatters
of the routed rows, the router's selection ops and attention.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from shardwise.bench_result import BenchRun, add_machine_note

INDEX_OPS = ("aten::index_select", "aten::index_add", "aten::index_add_", "aten::scatter_add_", "aten::index",
             "aten::index_put_", "aten::repeat_interleave")
ROUTER_OPS = ("aten::topk", "aten::sort", "aten::_softmax", "aten::_softmax_backward_data", "aten::cumsum",
              "aten::one_hot")


def build(moe: bool, batch: int):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model.transformer import Transformer

    overrides = {"model.preset": "cpu-demo", "data.seq_len": "128"}
    if moe:
        overrides.update({"model.n_experts": "64", "model.moe_top_k": "8", "model.moe_d_ff": "128"})
    cfg = resolve(Config.load(overrides=overrides), world_size=1, tokenizer_vocab=257).model
    model = Transformer(cfg)
    model.reset_parameters(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # as build_optimizer on a CPU
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, 128), generator=gen) for _ in range(2))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def profile_step(step, steps: int = 3) -> dict[str, float]:
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps
    ops = {e.key: e for e in prof.key_averages()}

    def total(name: str) -> float:
        return ops[name].cpu_time_total / 1e3 / steps if name in ops else 0.0

    def self_of(names) -> float:
        return sum(ops[n].self_cpu_time_total for n in names if n in ops) / 1e3 / steps

    return {"step_ms": wall * 1e3, "expert_gemm_ms": total("aten::_grouped_mm"),
            "optimizer_ms": total("Optimizer.step#AdamW.step"), "casts_ms": self_of(["aten::copy_"]),
            "index_ops_ms": self_of(INDEX_OPS), "router_ops_ms": self_of(ROUTER_OPS),
            "attention_ms": total("aten::_scaled_dot_product_flash_attention_for_cpu")
            + total("aten::_scaled_dot_product_flash_attention_for_cpu_backward")}


def kernels(repeats: int = 10) -> dict[str, float]:
    """One 64-expert map, forward + backward, in ms: each way the experts' matmul can run, and the dense one."""
    e, d, h, n = 64, 256, 128, 16384
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(e), n, replacement=True, generator=gen).bincount(minlength=e)
    rounded = (counts + 63) // 64 * 64  # runs padded to a multiple of 64 rows: few shapes, cached kernels

    def backward(y):  # a gradient with real strides: the grouped GEMM refuses an expanded one
        y.backward(torch.ones_like(y))

    def timed(fn) -> float:
        fn()
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats * 1e3

    def grouped(dtype, runs):
        x = torch.randn(int(runs.sum()), d, dtype=dtype, requires_grad=True)
        w = torch.randn(e, h, d, dtype=dtype, requires_grad=True)
        offs = runs.cumsum(0).to(torch.int32)

        return lambda: backward(F.grouped_mm(x, w.transpose(-2, -1), offs=offs))

    def padded(dtype):
        c = int(counts.max())
        x = torch.randn(e, c, d, dtype=dtype, requires_grad=True)
        w = torch.randn(e, h, d, dtype=dtype, requires_grad=True)
        return lambda: backward(torch.bmm(x, w.transpose(1, 2)))

    xd = torch.randn(n // 8, d, dtype=torch.bfloat16, requires_grad=True)
    wd = torch.randn(h * 8, d, dtype=torch.bfloat16, requires_grad=True)
    return {"grouped_fp32_ms": timed(grouped(torch.float32, counts)),
            "grouped_bf16_runs_of_64_ms": timed(grouped(torch.bfloat16, rounded)),
            "padded_bmm_bf16_ms": timed(padded(torch.bfloat16)),
            "dense_bf16_same_flops_ms": timed(lambda: backward(F.linear(xd, wd)))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    add_machine_note(ap)
    args = ap.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "load_average_start": list(os.getloadavg())}
    for name, moe in (("dense", False), ("moe", True)):
        report[name] = profile_step(build(moe, args.batch))
        print(name, " ".join(f"{k} {v:.1f}" for k, v in report[name].items()))
    report["kernels_one_map"] = kernels()
    print("one 64-expert map, f+b:", " ".join(f"{k} {v:.2f}" for k, v in report["kernels_one_map"].items()))
    report["load_average_end"] = list(os.getloadavg())
    if args.json:
        bench_run.write(args.json, report)
    return report


if __name__ == "__main__":
    main()
