"""One collective of a given size as a closure: what the cost model's calibration and the benchmarks time."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .allreduce import all_reduce
from .collectives import all_gather, all_to_all, barrier, broadcast, gather, reduce, reduce_scatter, scatter


def run_collective(collective: str, algorithm: str, nbytes: int, group, n: int, verify: bool = False,
                   device: torch.device | None = None):
    """A closure performing one ``collective`` of ``nbytes`` (fp32, on ``device``, default CPU) with
    ``algorithm`` (without the per-call metadata check unless ``verify``: benchmarks time the algorithm)."""
    rooted = collective in ("broadcast", "reduce")
    count = max(nbytes // 4, 1) if rooted else max(nbytes // 4 // n, 1) * n
    rank = dist.get_rank(group)
    x = torch.randn(count, device=device)
    if collective == "all_reduce":
        return lambda: all_reduce(x, "sum", group, algorithm, verify=verify)
    if collective == "reduce_scatter":
        out = torch.empty(count // n, device=device)
        return lambda: reduce_scatter(out, x, "sum", group, algorithm, verify=verify)
    if collective == "all_gather":
        inp = x[:count // n].clone()
        return lambda: all_gather(x, inp, group, algorithm, verify=verify)
    if collective == "all_to_all":
        out = torch.empty_like(x)
        return lambda: all_to_all(out, x, group, algorithm, verify=verify)
    if collective == "broadcast":
        return lambda: broadcast(x, 0, group, algorithm, verify=verify)
    if collective == "reduce":
        return lambda: reduce(x, 0, "sum", group, algorithm, verify=verify)
    if collective == "gather":
        part = x[:count // n].clone()
        return lambda: gather(part, x if rank == 0 else None, 0, group, algorithm, verify=verify)
    if collective == "scatter":
        part = torch.empty(count // n, device=device)
        return lambda: scatter(part, x if rank == 0 else None, 0, group, algorithm, verify=verify)
    if collective == "barrier":
        return lambda: barrier(group, algorithm)
    raise ValueError(f"unknown collective {collective!r}")
