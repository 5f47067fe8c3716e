"""gloo's own collectives on this machine, fitted for the simulator: the ``[sim.native_collectives]`` table.

    python bench/gloo_collectives.py                      # groups of 2 and 4 ranks, prints the table and fits
    python bench/gloo_collectives.py --world 2 --into F.toml   # also writes the table into a hardware file

The engine hands tensor / sequence parallelism's collectives, the experts' all-to-all (``comm.algorithm =
"native"``), DataParallel's bucket all-reduce (the same) and every small synchronisation to the backend; the
simulator's links are calibrated on a ring shift (``dist/comm/cost.calibrate``), which says little about what
gloo's all-gather or reduce-scatter cost. So this times them: with ``world`` concurrent processes (one thread
each, as the trainer's ranks on this machine), for every group size n in (2, world) -- n = 2 under world 4 as
two groups side by side, as a tp 2 layout on 4 ranks runs -- all-reduce, all-gather, reduce-scatter and
all-to-all at sizes from 4 KiB to 16 MiB (``bytes`` as the simulator counts them: the vector of an
all-reduce, the whole buffer of the others; each call made as the engine makes it, :func:`engine_call`, and
after a few milliseconds of computation, as in a step: :data:`COMPUTE_S`), the median of each size's calls,
the slowest rank's. Then per collective and group size the line
``alpha + bytes / bandwidth`` by least squares on relative residuals (:func:`shardwise.dist.comm.fit.fit_line`,
Hockney 1994's two parameters), with its largest relative miss over the sizes (the fit's error).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

SIZES = tuple(4096 * 4**i for i in range(7))
"""4 KiB .. 16 MiB."""
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
"""The simulator's names (:data:`shardwise.sim.hardware.NATIVE_COLLECTIVES`)."""

def reps(nbytes: int) -> int:
    """Timed calls per size (the same on every rank: they must match): 30 up to 256 KiB, 5 at 16 MiB."""
    return max(5, min(30, (8 << 20) // nbytes * 3))


COMPUTE_S = 0.005
"""The computation before each timed call: about what a layer of ``bench/sim_validate.py``'s model computes
between two of tensor parallelism's collectives on this machine."""


def measure(world: int, sizes=SIZES, compute_s: float = COMPUTE_S) -> dict[str, dict[int, list[float]]]:
    """On one of ``world`` ranks of the default (gloo) group: ``{collective: {n: [median seconds per size]}}``
    for every group size n in (2, world), the maximum over ranks (a collective ends when its slowest rank does).
    Each timed call follows ``compute_s`` seconds of matrix products, as a collective in a training step
    follows the computation that produced its input: the ranks arrive from their own work, one sooner than the
    other, and the caches hold the products' data, not the buffer (0: calls back to back). Every rank must
    call it."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    compute = computation(compute_s)
    out: dict[str, dict[int, list[float]]] = {c: {} for c in COLLECTIVES}
    for n in sorted({2, world}):
        if world % n:
            continue
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]  # every rank makes every group
        group = groups[rank // n]
        for name in COLLECTIVES:
            medians = []
            for nbytes in sizes:
                call = engine_call(name, nbytes, group, n)
                call()
                dist.barrier()
                samples = []
                for _ in range(reps(nbytes)):
                    compute()
                    t0 = time.perf_counter()
                    call()
                    samples.append(time.perf_counter() - t0)
                medians.append(statistics.median(samples))
            worst = torch.tensor(medians, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            out[name][n] = worst.tolist()
        for g in groups:
            dist.destroy_process_group(g)
    return out


def computation(seconds: float):
    """A callable computing about ``seconds`` of 256 x 256 matrix products, the same number on every rank
    (rank 0's count: ranks must not differ by design, only by the machine's own jitter)."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    count = torch.tensor([round(seconds / ((time.perf_counter() - t0) / 20))])
    dist.broadcast(count, 0)

    def compute() -> None:
        for _ in range(int(count)):
            torch.mm(a, b)

    return compute


def engine_call(collective: str, nbytes: int, group, n: int):
    """One call of the backend's ``collective`` on ``nbytes`` of fp32, made as the engine makes it: an all-reduce
    in place (the engine's copy before it is one of the traced operators), the others into an output allocated
    for the call (``dist/functional.py``'s gather and reduce-scatter, the experts' dispatch), whose first touch
    the backend pays."""
    import torch
    import torch.distributed as dist

    count = max(nbytes // 4 // n, 1) * n
    x = torch.randn(count)
    if collective == "all-reduce":
        return lambda: dist.all_reduce(x, group=group)
    if collective == "all-gather":
        mine = x[:count // n].clone()
        return lambda: dist.all_gather_single(torch.empty(count), mine, group=group)
    if collective == "reduce-scatter":
        return lambda: dist.reduce_scatter_single(torch.empty(count // n), x, group=group)
    return lambda: dist.all_to_all_single(torch.empty(count), x, group=group)


def fit(sizes, seconds) -> dict[str, float]:
    """``{alpha_us, gbps, max_error}`` of the line through the medians (relative least squares)."""
    from shardwise.dist.comm.fit import fit_line, relative_errors

    alpha, per_byte = fit_line([float(b) for b in sizes], list(seconds))
    per_byte = max(per_byte, 1e-15)
    errors = relative_errors([alpha + per_byte * b for b in sizes], list(seconds))
    return {"alpha_us": alpha * 1e6, "gbps": 1 / per_byte / 1e9, "max_error": max(abs(e) for e in errors)}


def fits(measured: dict[str, dict[int, list[float]]], sizes=SIZES) -> dict[str, dict[int, dict[str, float]]]:
    return {c: {n: fit(sizes, t) for n, t in by_n.items()} for c, by_n in measured.items()}


def toml_table(fitted: dict[str, dict[int, dict[str, float]]]) -> str:
    """The ``[sim.native_collectives]`` tables of a hardware file (:mod:`shardwise.sim.hardware`)."""
    lines = []
    for collective, by_n in fitted.items():
        lines.append(f"[sim.native_collectives.{collective}]")
        for n, f in sorted(by_n.items(), key=lambda kv: int(kv[0])):
            lines.append(f"{n} = {{ alpha_us = {f['alpha_us']:.2f}, gbps = {f['gbps']:.5f}, "
                         f"max_error = {f['max_error']:.3f} }}")
        lines.append("")
    return "\n".join(lines)


def with_table(text: str, table: str) -> str:
    """A hardware file's text with its ``[sim.native_collectives.*]`` tables replaced by ``table`` (at the end)."""
    kept = re.sub(r"(?ms)^\[sim\.native_collectives\.[^\]]*\]\n.*?(?=^\[|\Z)", "", text).rstrip("\n")
    return kept + "\n\n" + table


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    result = measure(world)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int) -> dict[str, dict[int, list[float]]]:
    """:func:`measure` on ``world`` fresh processes."""
    import torch.multiprocessing as mp

    from shardwise.dist.mesh import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "native.json")
        mp.spawn(_rank, args=(world, free_port(), out), nprocs=world)
        raw = json.loads(Path(out).read_text())
    return {c: {int(n): t for n, t in by_n.items()} for c, by_n in raw.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4], help="concurrent processes (each a table)")
    ap.add_argument("--into", type=Path, nargs="*", default=[],
                    help="hardware files to write the table into, one per --world (replacing their own)")
    ap.add_argument("--json", type=Path, help="the medians and fits")
    add_machine_note(ap)
    args = ap.parse_args()
    if args.into and len(args.into) != len(args.world):
        ap.error(f"--into names {len(args.into)} files for {len(args.world)} --world values")
    for path in args.into:
        if not path.is_file():
            ap.error(f"--into {path}: no such hardware file")
    bench_run = BenchRun.start(__file__, None, args, output=args.json)
    report = {}
    for i, world in enumerate(args.world):
        measured = run(world)
        fitted = fits(measured)
        report[world] = {"sizes": list(SIZES), "median_s": measured, "fit": fitted}
        print(f"# {world} concurrent processes")
        for c, by_n in measured.items():
            for n, t in by_n.items():
                f = fitted[c][n]
                print(f"{c:>15} n={n}: " + " ".join(f"{s * 1e3:8.2f}" for s in t) +
                      f"  ms -> {f['alpha_us']:7.1f} us + bytes / {f['gbps']:.3f} GB/s, max error {f['max_error']:.0%}")
        print(toml_table(fitted))
        if args.into:
            write_into(args.into[i], toml_table(fitted))
    if args.json:
        bench_run.write(args.json, report)
    return 0


def write_into(path: Path, table: str) -> None:
    """``path`` with its native table replaced by ``table``: checked as the simulator reads it, then written whole
    (a temporary file renamed over it), or left as it was."""
    from shardwise.sim.hardware import read_sim_table

    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(with_table(path.read_text(), table))
    try:
        read_sim_table(tmp)
    except Exception:
        tmp.unlink()
        raise
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
