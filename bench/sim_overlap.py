"""The simulated MFU of our engine on wide data-parallel H100 layouts, before and after the overlaps of issue 34.

    python bench/sim_overlap.py --before-src /path/to/main/src --json bench/results/sim_overlap.json

Layouts (issue 34): GPT models on H100 nodes of 8, data parallelism 48 wide, sequence 4096, vocabulary 131,072
(untied head), bf16, micro-batch 1, 4 micro-batches per replica and pipeline stage (global batch 192 x pp),
sequence parallelism with tensor parallelism. The 1.7B row is the issue's own (its ZeRO-1 at 0.63 s against plain
data parallelism at 0.36 s before); the other shapes span the issue's range (tp 1-8, pp 1-16, up to 462B) and are
ours, not a published table. Every row is simulated three ways, each in a fresh process:

* ``before``: the engine and simulator of ``--before-src`` (e.g. the main branch's ``src``), no new fields;
* ``off``: this tree with every overlap of issue 34 off (``parallel.zero_overlap_param_gather``,
  ``parallel.zero_overlap_grad_reduce``, ``parallel.tp_comm_overlap`` false) -- what the simulator's other
  changes (the two-level reduce-scatter / all-gather) alone give;
* ``after``: this tree with the overlaps on (their defaults, and ``parallel.tp_comm_overlap`` true);
* ``after_bf16``: ``after`` with ZeRO's flat parameters and gradients in bf16 beside fp32 masters
  (``parallel.zero_param_dtype`` bf16: the weights gathered and the gradients reduce-scattered in bf16, as
  Megatron-Core's distributed optimizer gathers bf16 parameters); ZeRO rows only.

For each: step time, MFU and exposed communication per axis (s, the busiest rank), and the layout's fit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))
from shardwise.bench_result import SIMULATION, BenchRun, add_machine_note  # noqa: E402

LAYOUTS = [  # name, layers, d_model, heads, tp, pp, zero
    ("1.7B dp", 24, 2048, 16, 1, 1, 0),
    ("1.7B zero1", 24, 2048, 16, 1, 1, 1),
    ("1.7B zero2", 24, 2048, 16, 1, 1, 2),
    ("7B tp2", 32, 4096, 32, 2, 1, 1),
    ("18B tp4", 40, 6144, 48, 4, 1, 1),
    ("39B tp8 pp2", 48, 8192, 64, 8, 2, 1),
    ("76B tp8 pp4", 60, 10240, 80, 8, 4, 1),
    ("175B tp8 pp8", 96, 12288, 96, 8, 8, 1),
    ("462B tp8 pp16", 128, 16384, 128, 8, 16, 1),
]
DP = 48

POINT = r"""
import json, sys
from shardwise.sim.hardware import build_hardware
from shardwise.sim.simulate import load_config, simulate
overrides, nodes = json.loads(sys.argv[1]), int(sys.argv[2])
hw = build_hardware("H100", nodes, 8)
res = simulate(load_config(None, overrides, hw), hw)
print(json.dumps({"step_time_s": res.step_time_s, "mfu": res.mfu, "exposed_comm_s": res.exposed_s,
                  "peak_memory_gb": res.peak_bytes / 1e9}))
"""


def overrides(layers: int, d: int, heads: int, tp: int, pp: int, zero: int) -> dict[str, str]:
    out = {"model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": str(layers),
           "model.d_model": str(d), "model.n_heads": str(heads), "model.vocab_size": "131072",
           "model.max_seq_len": "4096", "model.tie_embeddings": "false", "data.seq_len": "4096",
           "train.precision": "bf16", "train.micro_batch": "1", "train.global_batch": str(DP * 4 * pp),
           "parallel.tp": str(tp), "parallel.pp": str(pp), "parallel.zero": str(zero)}
    if tp > 1:
        out["parallel.sequence_parallel"] = "true"
    return out


def point(src: Path, ov: dict[str, str], nodes: int) -> dict:
    out = subprocess.run([sys.executable, "-c", POINT, json.dumps(ov), str(nodes)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(src), "PATH": ""}, timeout=1800)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", type=Path, help="the src directory of the engine to compare with (e.g. main's)")
    ap.add_argument("--only", help="run only the layouts whose name contains this")
    ap.add_argument("--json", type=Path)
    add_machine_note(ap)
    args = ap.parse_args()
    bench_run = BenchRun.start(__file__, None, args, output=args.json, note=SIMULATION)
    off = {"parallel.zero_overlap_param_gather": "false", "parallel.zero_overlap_grad_reduce": "false"}
    rows = []
    for name, layers, d, heads, tp, pp, zero in LAYOUTS:
        if args.only and args.only not in name:
            continue
        ov = overrides(layers, d, heads, tp, pp, zero)
        nodes = DP * tp * pp // 8
        zero_off = off if zero in (1, 2) else {}
        tp_on = {"parallel.tp_comm_overlap": "true"} if tp > 1 else {}
        row = {"layout": name, "gpus": nodes * 8, "overrides": ov,
               "off": point(ROOT / "src", {**ov, **zero_off}, nodes),
               "after": point(ROOT / "src", {**ov, **tp_on}, nodes)}
        if zero:
            row["after_bf16"] = point(ROOT / "src", {**ov, **tp_on, "parallel.zero_param_dtype": "bf16"}, nodes)
        if args.before_src:
            row["before"] = point(args.before_src, ov, nodes)
        rows.append(row)
        cells = []
        for k in ("before", "off", "after", "after_bf16"):
            r = row.get(k)
            if r is None:
                continue
            if "error" in r:
                cells.append(f"{k}: {r['error'][:60]}")
                continue
            exp = " ".join(f"{a} {s:.3f}" for a, s in sorted(r["exposed_comm_s"].items()))
            cells.append(f"{k}: {r['step_time_s']:.3f} s MFU {100 * r['mfu']:.1f}% ({exp})")
        print(f"{name:>15} ({nodes * 8:>5} GPUs) | " + " | ".join(cells), flush=True)
    if args.json:
        bench_run.write(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
