"""The simulator on Megatron-Core's published H100 layouts (wide data parallelism), and where the time goes.

    python bench/sim_megatron_h100.py [--configs dp zero1 megatron] [--json bench/results/sim_megatron_h100.json]
                                      [--rows 1.7B 70B]

The table (Megatron-LM README, "Training Speed and Scalability", images/model_table.png of commit f2e5db4,
2024-07-15, Megatron-Core r0.8.0): GPT models of 1.7B to 462B parameters, vocabulary 131,072, sequence 4,096, on
up to 6,144 H100s, every row with data-parallel size 48; the published per-GPU teraFLOP/s and MFU are measured end
to end with Megatron-Core's data-parallel, tensor-parallel and pipeline overlaps on (--overlap-grad-reduce
--overlap-param-gather --tp-comm-overlap). Nothing here is fitted to them: the H100 is the catalogue's (989.4
TFLOP/s dense bf16, 3.35 TB/s HBM, NVLink 900 GB/s, one 400 Gbit/s NIC per GPU), with the simulator's defaults.

What is simulated is shardwise's engine on those layouts, as its config says: the table's heads, hidden size,
layers, tp, pp, GPUs and batch; GPT layers (LayerNorm, GELU MLP of 4h, learned positions) with untied embeddings
(the parameter counts match: 12·L·h² + 2·V·h gives 1.75B for the first row and 461B for the last); bf16; assumed
where the table is silent: micro-batch 1, no recomputation, flash attention, sequence parallelism with tp > 1, the
1F1B schedule, and one of the configurations of :data:`CONFIGS` per ``--configs``: ``dp`` (plain data
parallelism), ``zero1`` (the distributed optimizer's sharding, Megatron's --use-distributed-optimizer, with our
defaults: its gather and reduce-scatter overlapped), ``megatron`` (``zero1`` with what Megatron-Core's runs use
besides: tensor-parallel communication overlap, gradients reduced in bf16 and the gathered weights in bf16,
``parallel.tp_comm_overlap``, ``grad_reduce_dtype`` and ``zero_param_dtype``). For each row: the simulated MFU
beside the published one (both PaLM's count, full attention), the exposed communication per axis, and its causes
(:mod:`shardwise.sim.exposure`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardwise.bench_result import SIMULATION, BenchRun, add_machine_note  # noqa: E402
from shardwise.sim import exposure  # noqa: E402
from shardwise.sim.hardware import build_hardware  # noqa: E402
from shardwise.sim.simulate import load_config, simulate  # noqa: E402

TABLE = [  # size, heads, hidden, layers, tp, pp, dp, GPUs, batch, published TFLOP/s per GPU, published MFU
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
]
GPUS_PER_NODE = 8
CONFIGS = {
    "dp": {"parallel.zero": 0},
    "zero1": {"parallel.zero": 1},
    "megatron": {"parallel.zero": 1, "parallel.tp_comm_overlap": "true", "parallel.grad_reduce_dtype": "bf16",
                 "parallel.zero_param_dtype": "bf16"},
}
"""The configurations of the engine simulated on each row (``tp_comm_overlap`` only where tp > 1)."""


def overrides(row, config: str) -> dict[str, str]:
    _, heads, hidden, layers, tp, pp, dp, gpus, batch, _, _ = row
    extra = {k: v for k, v in CONFIGS[config].items() if tp > 1 or k != "parallel.tp_comm_overlap"}
    out = {"model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": layers, "model.d_model": hidden,
           "model.n_heads": heads, "model.vocab_size": 131072, "model.max_seq_len": 4096,
           "model.tie_embeddings": "false", "data.seq_len": 4096, "train.precision": "bf16",
           "train.recompute": "none", "train.global_batch": batch, "train.micro_batch": 1, "parallel.tp": tp,
           "parallel.pp": pp, "parallel.sequence_parallel": str(tp > 1).lower()}
    if pp > 1:
        out.update({"parallel.pp_schedule": "1f1b", "parallel.microbatches": batch // dp})
    out.update(extra)
    return {k: str(v) for k, v in out.items()}


def run(row, config: str, **sim) -> dict:
    gpus = row[7]
    hw = build_hardware("H100", gpus // GPUS_PER_NODE, GPUS_PER_NODE, **sim)
    t0 = time.perf_counter()
    res = simulate(load_config(None, overrides(row, config), hw), hw)
    s = res.summary()
    merged: dict[str, float] = {}
    for axis, v in s["exposed_comm_s"].items():
        key = {"dp_cp": "dp", "edp": "dp"}.get(axis, axis)
        merged[key] = merged.get(key, 0.0) + v
    return {"size": row[0], "tp": row[4], "pp": row[5], "dp": row[6], "gpus": gpus, "batch": row[8], "config": config,
            "overrides": overrides(row, config),
            "published_mfu": row[10], "published_tflops": row[9], "simulated_mfu": res.mfu,
            "simulated_mfu_causal": res.mfu_causal, "step_time_s": res.step_time_s, "bubble": res.bubble,
            "exposed_comm_s": merged, "fits": res.fits, "peak_memory_gb": res.peak_bytes / 1e9,
            "causes": s["exposed_causes"], "lines": exposure.text(res, top=3),
            "simulated_in_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                    help="engine configurations to simulate on every row (see CONFIGS)")
    ap.add_argument("--rows", nargs="*", help="sizes to run (default: all), e.g. 1.7B 70B")
    ap.add_argument("--quiet", action="store_true", help="no causes, one line per layout")
    ap.add_argument("--json", type=Path)
    add_machine_note(ap)
    args = ap.parse_args()
    bench_run = BenchRun.start(__file__, None, args, output=args.json,
                               note=f"{SIMULATION} (the catalogue's H100 SXM nodes of 8)")
    out = []
    for row in TABLE:
        if args.rows and row[0] not in args.rows:
            continue
        for config in args.configs:
            r = run(row, config)
            out.append(r)
            comm = ", ".join(f"{k} {v:.3g}" for k, v in sorted(r["exposed_comm_s"].items()))
            fit = "" if r["fits"] else f"  DOES NOT FIT ({r['peak_memory_gb']:.0f} GB)"
            print(f"{r['size']:>5} tp{r['tp']} pp{r['pp']:<2} dp{r['dp']} {config:>8}: published MFU "
                  f"{r['published_mfu']:.0%}, simulated {r['simulated_mfu']:.1%} (step {r['step_time_s']:.3f} s"
                  + (f", bubble {r['bubble']:.1%}" if r["bubble"] is not None else "") + f"); exposed s: {comm}{fit}"
                  f"  [{r['simulated_in_s']:.1f} s]", flush=True)
            if not args.quiet:
                for line in r["lines"][1:]:
                    print("      " + line)
    if args.json:
        doc = {"source": "Megatron-LM README images/model_table.png (commit f2e5db4, 2024-07-15)",
               "rows": [{k: v for k, v in r.items() if k != "lines"} for r in out]}
        bench_run.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
