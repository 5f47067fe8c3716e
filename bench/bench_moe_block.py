"""Benchmark: our mixture-of-experts block against transformers' Mixtral sparse-MoE block, same weights.

Part 1 (the comparison). ``shardwise.model.moe.MoE`` (llama flavour, the ``softmax_renorm`` router, top-k = E)
and ``transformers``' ``MixtralSparseMoeBlock`` with top-k = E compute the same function: every token goes
to every expert, gated by the softmax of the router logits (renormalising all E gates changes nothing). Our
weights are copied into theirs (router; ``gate_up_proj [E, 2f, d]`` = our gate and up projections
concatenated; ``down_proj``), the outputs and input gradients are checked equal, then forward + backward of
both are timed, interleaved (A B, B A, ...) in one process. Theirs runs with each of transformers' expert
implementations: ``eager`` (a Python loop over the experts hit; the standalone block's default),
``grouped_mm`` (what ``from_pretrained`` picks) and ``batched_mm``. Reported per E: the median CPU seconds
per forward + backward (``time.process_time``, ``--threads`` torch threads, 1 by default so other jobs on
a shared machine disturb it least), the median wall seconds, and the median of the per-round ratios ours /
theirs (target <= 1.0 against each).

Part 2 (``--kernels``): our experts' three kernels (:mod:`shardwise.model.expert_matmul`: one grouped GEMM, a
padded batched matmul, a loop over experts) at top-2 routing with more and more uneven loads, the
measurement behind ``PAD_ROWS_PER_EXPERT`` (the padding up to which the padded matmul beats the loop).

    python bench/bench_moe_block.py --experts 8 64 --kernels

Results go to bench/results/moe_block.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO / "src"))
from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

RESULTS = REPO / "bench" / "results" / "moe_block.json"


def build_pair(n_experts: int, d_model: int, width: int, implementation: str, seed: int = 0):
    """Our MoE block and transformers' Mixtral block holding the same weights, top-k = E."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from shardwise.model.moe import MoE

    torch.manual_seed(seed)
    ours = MoE(d_model, width, "llama", n_experts, n_experts, router="softmax_renorm")
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=d_model ** -0.5)
    config = MixtralConfig(hidden_size=d_model, intermediate_size=width, num_local_experts=n_experts,
                           num_experts_per_tok=n_experts, hidden_act="silu")
    config._experts_implementation = implementation
    theirs = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        e = ours.experts
        theirs.experts.gate_up_proj.copy_(torch.cat([e.gate_proj.weight, e.up_proj.weight], dim=1))
        theirs.experts.down_proj.copy_(e.down_proj.weight)
    return ours.train(), theirs.train()


def fwd_bwd(block, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    block(x).backward(grad)
    return x.grad


def check_same(ours, theirs, x) -> dict:
    y1, y2 = ours(x), theirs(x)
    g = torch.randn_like(y1)
    g1, g2 = fwd_bwd(ours, x, g), fwd_bwd(theirs, x, g)
    for m in (ours, theirs):
        m.zero_grad(set_to_none=True)
    return {"max_abs_diff_out": float((y1 - y2).detach().abs().max()),
            "max_abs_diff_input_grad": float((g1 - g2).abs().max())}


def timed(fn) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def compare(args, n_experts: int) -> dict:
    width = args.expert_width // n_experts
    x = torch.randn(args.batch, args.seq, args.d_model)
    grad = torch.randn_like(x)
    out: dict = {"experts": n_experts, "top_k": n_experts, "expert_width": width, "tokens": args.batch * args.seq}
    for impl in args.implementations:
        ours, theirs = build_pair(n_experts, args.d_model, width, impl)
        same = check_same(ours, theirs, x)
        rows = {"ours": [], "theirs": []}
        for r in range(args.warmup + args.reps):
            order = (("ours", ours), ("theirs", theirs)) if r % 2 == 0 else (("theirs", theirs), ("ours", ours))
            got = {}
            for name, block in order:
                got[name] = timed(lambda b=block: fwd_bwd(b, x, grad))
                block.zero_grad(set_to_none=True)
            if r >= args.warmup:
                for name in rows:
                    rows[name].append(got[name])
        cpu = {k: statistics.median(c for c, _ in v) for k, v in rows.items()}
        wall = {k: statistics.median(w for _, w in v) for k, v in rows.items()}
        ratio_cpu = statistics.median(a[0] / b[0] for a, b in zip(rows["ours"], rows["theirs"], strict=True))
        ratio_wall = statistics.median(a[1] / b[1] for a, b in zip(rows["ours"], rows["theirs"], strict=True))
        out[impl] = {**same, "cpu_s": cpu, "wall_s": wall, "ratio_cpu": ratio_cpu, "ratio_wall": ratio_wall}
        print(f"E={n_experts:3d} vs {impl:10s}: ours {cpu['ours'] * 1e3:7.2f} ms cpu, theirs {cpu['theirs'] * 1e3:7.2f}"
              f" ms; ratio cpu {ratio_cpu:.3f} wall {ratio_wall:.3f}; |dy| {same['max_abs_diff_out']:.1e}",
              flush=True)
    return out


def kernels(args) -> list[dict]:
    """Our three kernels on top-2 routing of ``--batch x --seq`` tokens, loads from even to skewed, fp32 and
    under bf16 autocast. Every call draws new counts from the same skew, as training does: on a CPU, oneDNN
    builds a bf16 matmul kernel for every new shape (about 1 ms here), which a loop over experts (and the
    grouped GEMM, a loop of matmuls on the CPU) pays per expert and the padded matmul once."""
    from shardwise.model.moe import Experts

    rows = []
    n = args.batch * args.seq * 2
    for n_experts in args.experts:
        width = args.expert_width // n_experts
        experts = Experts(n_experts, args.d_model, width, "llama")
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.02)
        for precision in ("fp32", "bf16"):
            for skew in (0.0, 0.5, 1.0, 2.0):
                weights = torch.arange(n_experts, dtype=torch.float64).mul(-skew / n_experts * 4).exp()
                draws = [torch.distributions.Multinomial(n, weights).sample().long()
                         for _ in range(args.warmup + max(3, args.reps // 2))]
                x = torch.randn(n, args.d_model)
                grad = torch.randn_like(x)
                padding = statistics.mean(n_experts * int(c.max()) / n for c in draws)
                times = {}
                for kernel in ("grouped", "padded", "loop"):
                    experts.kernel = kernel
                    samples = []
                    for r, counts in enumerate(draws):
                        xr = x.detach().requires_grad_()
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                            c, _ = timed(lambda e=experts, a=xr, n=counts, g=grad: e(a, n).float().backward(g))
                        if r >= args.warmup:
                            samples.append(c)
                    times[kernel] = statistics.median(samples)
                experts.kernel = "auto"
                rows.append({"experts": n_experts, "precision": precision, "padding": padding, "cpu_s": times})
                print(f"E={n_experts:3d} {precision} padding {padding:5.2f}: " +
                      ", ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in times.items()), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--expert-width", type=int, default=4096, help="summed width of all experts (f = this / E)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--implementations", nargs="+", default=["eager", "grouped_mm"],
                    help="transformers expert implementations to compare with (batched_mm too: slow on CPU)")
    ap.add_argument("--kernels", action="store_true", help="also time our three expert kernels (part 2)")
    ap.add_argument("--json", type=Path, default=RESULTS)
    add_machine_note(ap)
    args = ap.parse_args(argv)
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    torch.set_num_threads(args.threads)
    import transformers

    result = {"benchmark": "MoE block forward+backward: ours vs transformers MixtralSparseMoeBlock, top-k = E",
              "host": platform.node(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "blocks": [compare(args, e) for e in args.experts]}
    if args.kernels:
        result["kernels"] = kernels(args)
    bench_run.write(args.json, result)


if __name__ == "__main__":
    main()
