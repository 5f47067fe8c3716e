"""Where the simulator misses a layout on this machine: computation or communication, measured apart.

    python bench/sim_gap.py [--hardware-dir bench/results] [LAYOUT ...]     # default: tp 2, tp 2 + SP, cp 2, ep 2

For a layout of ``bench/sim_validate.py`` on 2 ranks, the forward and backward of one step's micro-batches (the
engine's model as ``parallelize()`` rewrites it: no optimizer, data or metrics) timed three ways, one thread per
process, the fastest of a few steps:

* ``mirror``: 2 concurrent processes whose parallel modules run on :class:`~shardwise.sim.mirror.MirrorGroup`
  groups -- the same operators on the same shapes, every collective answered at once: the computation alone,
  with the other rank's computation competing for the cores as in the trainer;
* ``gloo``: the same on 2 real gloo ranks: the computation plus the real communication and its waits;

beside the simulator's computation and exposed communication for the same rank (the hardware file of
``--hardware-dir``). ``gloo - mirror`` is what communication really adds; against the simulated communication it
says whether the communication model or the compute model misses. Timings on a shared machine are noise: run it
alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

from sim_validate import LAYOUTS, MODEL, flags  # noqa: E402  (bench/, on the path above)

STEPS = 6


def config(name: str, hardware_dir: Path):
    from shardwise.cli import split_overrides
    from shardwise.sim.hardware import build_hardware
    from shardwise.sim.simulate import load_config

    _, ranks, over = next(layout for layout in LAYOUTS if layout[0] == name)
    _, overrides = split_overrides(MODEL + flags(over))
    hw = build_hardware(f"this-cpu-{ranks}", 1, ranks, hardware_dir / f"sim_this_machine_k{ranks}.toml")
    return load_config(None, overrides, hw), hw


def fastest_step(cfg, mesh) -> float:
    """The fastest of :data:`STEPS` forward-and-backward passes over one step's micro-batches (after one)."""
    import torch
    import torch.distributed as dist

    from shardwise.dist.comm.counting import CommLedger
    from shardwise.model.transformer import Transformer
    from shardwise.parallel.parallelize import parallelize

    plain = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute="none", compile=False))
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    parallelize(model, mesh, plain, CommLedger())
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len // cfg.parallel.cp))
    times = []
    for _ in range(STEPS + 1):
        if dist.get_backend() == "gloo":
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg.train.grad_accum):
            model(ids, ids).backward()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _rank(rank: int, kind: str, name: str, hardware_dir: Path, port: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from shardwise.sim.engine_trace import trace_dims
    from shardwise.sim.mirror import mirror_mesh

    torch.set_num_threads(1)
    cfg, _ = config(name, hardware_dir)
    dims = trace_dims(cfg)
    if kind == "mirror":
        with mirror_mesh(dims) as mesh:
            seconds = fastest_step(cfg, mesh)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=dims.world_size)
        seconds = fastest_step(cfg, dims.build("cpu"))
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(str(seconds))


def measure(kind: str, name: str, hardware_dir: Path) -> float:
    import torch.multiprocessing as mp

    from shardwise.dist.mesh import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "t")
        mp.spawn(_rank, args=(kind, name, hardware_dir, free_port(), out), nprocs=2)
        return float(Path(out).read_text())


def simulated(name: str, hardware_dir: Path) -> tuple[float, float]:
    """``(computation, exposed communication)`` seconds of rank 0's forward and backward tasks, simulated."""
    from shardwise.sim.simulate import simulate

    cfg, hw = config(name, hardware_dir)
    res = simulate(cfg, hw)
    segments = [s for t in res.graph.rank_tasks(0) if t.kind in ("F", "B") for s in t.segments]
    return sum(s for _, axis, s in segments if axis is None), sum(s for _, axis, s in segments if axis is not None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layouts", nargs="*", default=["tp 2", "tp 2 + SP", "cp 2", "ep 2"])
    ap.add_argument("--hardware-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    from shardwise.sim.engine_trace import trace_dims

    for name in args.layouts:
        if name not in [layout[0] for layout in LAYOUTS]:
            ap.error(f"{name!r} is not a layout of bench/sim_validate.py")
        if trace_dims(config(name, args.hardware_dir)[0]).world_size != 2:
            ap.error(f"{name!r}: no tensor-, context- or expert-parallel pair of ranks to run apart")
        compute, comm = simulated(name, args.hardware_dir)
        mirror, gloo = (measure(kind, name, args.hardware_dir) for kind in ("mirror", "gloo"))
        print(f"{name:<10} computation: mirror {mirror * 1e3:6.1f} ms, simulated {compute * 1e3:6.1f} "
              f"({compute / mirror - 1:+.0%}); communication: gloo - mirror {(gloo - mirror) * 1e3:6.1f} ms, "
              f"simulated {comm * 1e3:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
