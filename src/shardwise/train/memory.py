"""The memory accountant: bytes of model state a rank holds, by category, counted from its storages.

Categories follow Rajbhandari et al. 2020, "ZeRO", §3.1 (model states): ``params`` (the
parameters the model computes with), ``grads``, ``master`` (fp32 master weights kept *apart*
from the parameters; 0 when the parameters themselves are fp32, as in this trainer, where
``torch.autocast`` makes the low-precision compute copies on the fly), and ``optimizer`` (Adam's
two moments; AdamW's 0-dimensional ``step`` counters are left out). The paper's K = 12 bytes per
parameter is ``master`` + ``optimizer`` in the mixed-precision layout.

What is counted is *measured*: the bytes of the distinct storages (``untyped_storage().nbytes()``)
behind the tensors that hold each category -- the parameters and their ``.grad``, a data-parallel
wrapper's bucket buffers, ZeRO's flat buffers, shards, master pieces and offload buffers, the
optimizer's state -- with every storage counted once, in the first category that reaches it (a
gradient that is a view of a bucket counts the bucket; a master that is a view of the shard counts
nowhere twice). So padding, flags travelling in a bucket, or a copy nobody meant to keep show up.
States streamed to disk (``offload = "disk"``) count the bytes of their files. ZeRO++ hpZ's
secondary partitions live from a unit's forward to its backward: they count at the peak the
partition measured while they were allocated. Transient buffers (a ZeRO-3 unit's gathered
parameters, autocast copies, activations) are left out; the flat buffers ZeRO keeps between steps
for reuse are reported apart as ``buffers`` (not part of ``total``). Inside a pipeline, what a ZeRO-2/3 step
holds at its flush is reported apart too, measured from the storages then (``ZeroDataParallel.flush_bytes``):
``gathered`` (ZeRO-3's units, gathered from their first forward to the flush) and ``grad_accum`` (the
gradients accumulated unsharded over the micro-batches before the one reduce-scatter). The trainer samples
after the optimizer step, before gradients are released. ``allocator_peak`` is added on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

CATEGORIES = ("params", "grads", "master", "optimizer")


def storage_bytes(categories: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes of the distinct storages behind each category's tensors; a storage reached again (in
    the same or a later category) is not counted again."""
    seen: set[tuple[str, int]] = set()
    out = {}
    for name, tensors in categories.items():
        total = 0
        for t in tensors:
            if t is None or t.is_meta:
                continue
            st = t.untyped_storage()
            key = (str(t.device), st.data_ptr())
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
        out[name] = total
    return out


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "inner", optimizer)
    return [v for state in inner.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def _zero_categories(engine) -> dict[str, list]:
    units, masters = engine.units, engine.masters
    return {
        "params": [t for u in units for t in (u.full, u.shard)] + list(engine.module.parameters()),
        "grads": [t for u in units for t in (u.grad_full, u.grad_shard)]
                 + [p.grad for p in engine.module.parameters()] + [m.grad for m in masters.params()]
                 + list(masters.grad_buffers()),
        "master": masters.params(),
    }


def model_state_bytes(engine, optimizer) -> dict[str, int]:
    """Bytes of model state on this rank for a ``DataParallel``, ``ZeroDataParallel`` or pipeline
    wrapper (anything with ``.module``), measured from storages (see the module docstring)."""
    from shardwise.parallel.zero import ZeroDataParallel

    if isinstance(engine, ZeroDataParallel):
        cats = _zero_categories(engine)
    else:
        params = list(engine.module.parameters())
        buckets = [b.buffer for b in getattr(engine, "_buckets", ())]  # DataParallel's gradient buckets
        cats = {"params": params, "grads": [p.grad for p in params] + buckets, "master": []}
    out = storage_bytes({**cats, "optimizer": _optimizer_tensors(optimizer)})
    if isinstance(engine, ZeroDataParallel):
        out["params"] += engine.hpz.peak_bytes  # measured while the secondary partitions existed
        # kept between steps for reuse (flat gradients, exchange scratch): real, but not model state
        out["buffers"] = storage_bytes({"b": list(getattr(getattr(engine, "_grad_pool", None), "free", ()))})["b"]
        # a pipeline step's flush: ZeRO-3's units held gathered and stages 2-3's unsharded gradients (not in total)
        out.update(engine.flush_bytes)
        disk = engine.masters.disk
        if disk is not None:  # states streamed to files: their sizes on disk
            files = disk.file_bytes()
            out["master"] += files.pop("master", 0)
            out["optimizer"] += sum(files.values())
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
