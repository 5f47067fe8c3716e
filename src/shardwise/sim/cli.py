"""``shardwise simulate``: one training step of a config on a simulated cluster, from the engine's own schedules.

Takes the same config tree and ``--section.key VALUE`` overrides as ``shardwise train`` and ``shardwise plan``;
``--sim.KEY VALUE`` sets a field of the hardware file's ``[sim]`` table (:mod:`shardwise.sim.hardware`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardwise.config import ConfigError

SIM_FLAGS = ("sim.",)
DOES_NOT_FIT = 3
"""Exit status when a rank's simulated peak memory exceeds the device's (the summary says so, ``--json`` has
``"fits": false``)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise simulate", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="TOML config file (the same as for shardwise train)")
    p.add_argument("--gpu", default="H100", help="GPU type from the catalogue (default H100)")
    p.add_argument("--nodes", type=int, help="nodes (default parallel.nnodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default parallel.nproc if set, else 8)")
    p.add_argument("--hardware", help="TOML file: [gpu.NAME] tables (as for plan) and a [sim] table")
    p.add_argument("--steps", type=int, default=1, help="steps to put in the trace (identical; default 1)")
    p.add_argument("--trace", type=Path, help="write a Chrome-trace / Perfetto JSON of every simulated rank")
    p.add_argument("--plot", type=Path, help="write a PNG of the busiest ranks' timelines")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="the busiest expert rank's tokens over the balanced share (default 1: balanced routing)")
    p.add_argument("--mtbf-hours", type=float,
                   help="per-GPU mean time between failures, hours (default: the Llama 3 report's 50,677)")
    p.add_argument("--ckpt-write-s-per-gb", type=float,
                   help="the trainer's checkpoint writer, seconds per GB (default: measured here now)")
    p.add_argument("--ckpt-read-s-per-gb", type=float,
                   help="the trainer's checkpoint reader, seconds per GB (default: measured here now)")
    return p


def main(argv: list[str], overrides: dict[str, str]) -> int:
    from shardwise.plan.params import count_params
    from shardwise.plan.spec import model_spec
    from shardwise.sim import failures, report
    from shardwise.sim.hardware import FIELDS, build_hardware
    from shardwise.sim.simulate import load_config, simulate

    args = build_parser().parse_args(argv)
    sim = {k.partition(".")[2]: v for k, v in overrides.items() if k.startswith(SIM_FLAGS)}
    overrides = {k: v for k, v in overrides.items() if not k.startswith(SIM_FLAGS)}
    for key, value in list(sim.items()):
        if key not in FIELDS:
            raise ConfigError(f"--sim.{key} is not a field of [sim]; valid: {', '.join(sorted(FIELDS))}")
        if FIELDS[key] is dict:
            raise ConfigError(f"--sim.{key} is a table: write it in the --hardware file ([sim.{key}])")
        try:
            sim[key] = FIELDS[key](value)
        except ValueError:
            raise ConfigError(f"--sim.{key}={value!r} must be a {FIELDS[key].__name__}") from None
    if args.steps < 1 or args.moe_imbalance < 1:
        raise ConfigError(f"--steps={args.steps} and --moe-imbalance={args.moe_imbalance} must be >= 1")
    from shardwise.sim.simulate import read_config

    base = read_config(args.config, overrides)
    nodes = base.parallel.nnodes if args.nodes is None else args.nodes
    gpn = (base.parallel.nproc or 8) if args.gpus_per_node is None else args.gpus_per_node
    hw = build_hardware(args.gpu, nodes, gpn, args.hardware, **sim)
    cfg = load_config(args.config, overrides, hw)
    res = simulate(cfg, hw, args.moe_imbalance)
    write, read = args.ckpt_write_s_per_gb, args.ckpt_read_s_per_gb
    if write is None or read is None:
        measured = failures.measure_checkpoint_rates()
        write, read = write or measured[0], read or measured[1]
    p = cfg.parallel
    writers = hw.world if p.zero else p.tp * p.pp * max(1, p.ep)
    fail = failures.failure_report(count_params(model_spec(cfg)).total, hw.world, writers, res.step_time_s, write,
                                   read, hw.storage_write_bw, hw.storage_read_bw, hw.restart_s,
                                   args.mtbf_hours or failures.LLAMA3_GPU_HOURS_PER_FAILURE)
    if args.trace:
        report.write_trace(res, args.trace, args.steps)
    if args.plot:
        report.plot(res, args.plot, title=f"{cfg.model.preset} on {hw.world} x {hw.gpu.name}")
    if args.json:
        print(json.dumps({**res.summary(), "failures": fail, "hardware": _hardware_doc(hw)}, indent=2, default=str))
    else:
        print("\n".join(report.text(res, fail)))
        for path in (args.trace, args.plot):
            if path:
                print(f"wrote {path}")
    return 0 if res.fits else DOES_NOT_FIT


def _hardware_doc(hw) -> dict:
    return {"gpu": hw.gpu.name, "nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node, "hbm_bytes_per_s": hw.hbm_bw,
            "matmul_efficiency": hw.matmul_efficiency, "attention_efficiency": hw.attention_efficiency,
            "memory_efficiency": hw.memory_efficiency, "attention": hw.attention, "backend": hw.backend,
            "nic_bytes_per_s": hw.nic_bandwidth, "nics_per_node": hw.nics, "leaf_nodes": hw.leaf_nodes,
            "oversubscription": hw.oversubscription,
            "native_collectives": [{"collective": line.collective, "ranks": line.ranks, "alpha_s": line.alpha,
                                    "seconds_per_byte": line.seconds_per_byte} for line in hw.native_collectives]}
