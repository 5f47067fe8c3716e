"""How the simulator's own cost grows: wall time, simulated tasks and peak memory of one step against the model's
layers, the micro-batches, the pipeline stages and the nodes (each point in a fresh process, so its peak RSS is
its own, ``resource.getrusage``; the wall time of ``simulate`` after a warm-up on a tiny model, so torch's lazy
imports are not in it).

    python bench/sim_scaling.py --json bench/results/sim_scaling.json

Base: GPT-3 175B's shape (d 12288, 96 heads), tp 8, interleaved 1F1B with 2 chunks per rank, micro-batch 1, full
recomputation, bf16, H100 nodes of 8; one quantity varies at a time.
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
from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

POINT = r"""
import json, resource, sys, time
from shardwise.sim.hardware import build_hardware
from shardwise.sim.simulate import load_config, simulate
layers, m, pp, nodes = map(int, sys.argv[1:5])
hw = build_hardware("H100", nodes, 8)
dp = nodes * 8 // (8 * pp)
cfg = load_config(None, {"model.preset": "gpt3-175b", "model.n_layers": str(layers), "parallel.tp": "8",
                         "parallel.pp": str(pp), "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": "2",
                         "parallel.pp_partition": "even", "train.micro_batch": "1",
                         "train.global_batch": str(m * dp), "train.recompute": "full", "train.precision": "bf16"}, hw)
small = build_hardware("H100", 1, 8)  # warm-up: torch's lazy imports and the first meta-device build
simulate(load_config(None, {"model.preset": "tiny"}, small), small)
t0 = time.perf_counter()
res = simulate(cfg, hw)
print(json.dumps({"wall_s": time.perf_counter() - t0, "tasks": len(res.graph.tasks),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "step_time_s": res.step_time_s, "world": hw.world}))
"""

BASE = {"layers": 96, "microbatches": 32, "stages": 8, "nodes": 128}
SWEEPS = {"layers": [48, 96, 192], "microbatches": [16, 64, 256], "stages": [4, 16, 32], "nodes": [16, 256, 2048]}


def point(layers: int, m: int, pp: int, nodes: int) -> dict:
    out = subprocess.run([sys.executable, "-c", POINT, str(layers), str(m), str(pp), str(nodes)], check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    add_machine_note(ap)
    args = ap.parse_args()
    bench_run = BenchRun.start(__file__, None, args, output=args.json)
    rows = []
    for name, values in SWEEPS.items():
        for value in values:
            cfg = {**BASE, name: value}
            r = {"varied": name, **cfg, **point(cfg["layers"], cfg["microbatches"], cfg["stages"], cfg["nodes"])}
            rows.append(r)
            print(f"{name:>12} = {value:>5}: {r['world']:>6} GPUs, {r['tasks']:>7} tasks, {r['wall_s']:6.2f} s, "
                  f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    if args.json:
        bench_run.write(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
