"""The memory accountant: bytes of model state a rank holds, by category.

Categories follow Rajbhandari et al. 2020, "ZeRO", §3.1 (model states): ``params`` (the
parameters the model computes with), ``grads``, ``master`` (fp32 master weights kept *apart*
from the parameters; 0 when the parameters themselves are fp32, as in this trainer, where
``torch.autocast`` makes the low-precision compute copies on the fly), and ``optimizer`` (Adam's
two moments; AdamW's scalar ``step`` counters are not counted). The paper's K = 12 bytes per
parameter is ``master`` + ``optimizer`` in the mixed-precision layout.

What is counted is the *capacity* each technique holds across a step, read from its buffers,
not instantaneous allocations: ZeRO's flat buffers are padded to a multiple of the data-parallel
size N, so Ψ below means the padded element count (Σ over units of ⌈numel/N⌉·N); transient
buffers (a ZeRO-3 unit's gathered parameters, reduce-scatter staging, autocast copies,
activations) are left out. ``allocator_peak`` is added on CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CATEGORIES = ("params", "grads", "master", "optimizer")


def _optimizer_bytes(optimizer) -> int:
    if hasattr(optimizer, "state_bytes"):
        return int(optimizer.state_bytes())
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
    return total


def model_state_bytes(engine, optimizer) -> dict[str, int]:
    """Bytes of model state on this rank for a ``DataParallel`` or ``ZeroDataParallel`` wrapper."""
    from shardwise.parallel.zero import ZeroDataParallel

    out = dict.fromkeys(CATEGORIES, 0)
    if isinstance(engine, ZeroDataParallel):
        out.update(engine.model_state_bytes())  # padded flat buffers, plus hpZ's secondary copies
    else:
        params = [p for p in engine.module.parameters() if p.requires_grad]
        params = list({id(p): p for p in params}.values())
        out["params"] = sum(p.numel() * p.element_size() for p in params)
        out["grads"] = out["params"]  # one gradient per parameter (DataParallel's bucket views)
    out["optimizer"] = _optimizer_bytes(optimizer)
    out["total"] = sum(out[k] for k in CATEGORIES)
    if torch.cuda.is_available():
        out["allocator_peak"] = int(torch.cuda.max_memory_allocated())
    return out


def zero_formula_bytes(stage: int, psi: int, n: int, k: int = 12) -> int:
    """Model-state bytes per rank from Rajbhandari et al. 2020, §5.4 / Figure 1, mixed precision
    (2-byte parameters and gradients, K bytes of optimizer state per parameter), N ranks:
    stage 0: (2+2+K)Ψ; 1: 4Ψ + KΨ/N; 2: 2Ψ + (2+K)Ψ/N; 3: (2+2+K)Ψ/N (Ψ padded to a multiple of N)."""
    if psi % n:
        raise ValueError(f"psi={psi} must be padded to a multiple of n={n}")
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi // n, 2: 2 * psi + (2 + k) * psi // n,
            3: (4 + k) * psi // n}[stage]


def gather_per_rank(accounted: dict[str, int], group=None) -> list[dict[str, int]]:
    """Every rank's accounting, on every rank (a collective)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [accounted]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, accounted, group=group)
    return out


def format_table(per_rank: list[dict[str, int]], title: str = "model-state bytes per rank") -> str:
    """A plain-text table: one row per category, one column per rank, in MiB."""
    keys = [k for k in per_rank[0] if k != "total"] + ["total"]
    head = f"{'':<12}" + "".join(f"{'rank ' + str(r):>12}" for r in range(len(per_rank)))
    rows = [f"{k:<12}" + "".join(f"{d.get(k, 0) / 2**20:>10.2f}Mi" for d in per_rank) for k in keys]
    return "\n".join([title, head, *rows])
