"""The library API: shardwise's techniques inside one's own torchrun script and one's own ``nn.Module``.

::

    from shardwise import api

    ctx = api.init()                                             # process group (torchrun env) + mesh
    model = api.data_parallel(MyModel().to(ctx.device), algorithm="ring")   # or native, tree, ...
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # or ZeRO 1-3:  model, opt = api.zero(MyModel(), lambda m: torch.optim.AdamW(m.parameters()), stage=3)
    loader = api.data_loader(dataset, global_batch=64, ctx=ctx, seed=0)   # this rank's share of each batch
    start = api.load_checkpoint("ckpt", model, opt)              # None, or the step to continue from
    ...  loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    api.save_checkpoint("ckpt", step, model, opt)

What the trainer uses, without its config tree: :class:`~shardwise.parallel.data.DataParallel` (bucketed
all-reduce from autograd hooks, any of our all-reduce algorithms and compressions,
:mod:`shardwise.dist.comm`), :class:`~shardwise.parallel.zero.ZeroDataParallel` with its
:class:`~shardwise.parallel.zero.ZeroOptimizer` (Rajbhandari et al. 2020), and the sharded layout-free
checkpoints of :mod:`shardwise.train.sharded` (each rank writes what it holds; a checkpoint written under
one wrapper or world size loads under another). Data sharding is torch's ``DistributedSampler`` over the
data-parallel ranks (Goyal et al. 2017 §2: a fixed global batch split evenly, gradients averaged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.compress import GradientAllReduce
from shardwise.dist.mesh import Mesh, ParallelDims, init_distributed
from shardwise.parallel.data import DataParallel
from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer

__all__ = ["Context", "init", "data_parallel", "zero", "data_loader", "save_checkpoint", "load_checkpoint"]


@dataclass
class Context:
    """This process's place in the job: global rank and size, its device, and the mesh (data parallel over
    every rank: ``mesh.dp_group``)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(backend: str = "auto", timeout_s: float = 600.0) -> Context:
    """Join the job torchrun started (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment; a one-rank
    group without them) and build the data-parallel mesh. ``backend``: "auto" (nccl with GPUs), "nccl", "gloo";
    ``timeout_s`` bounds rendezvous and every collective (an absent peer is an error, not a hang)."""
    rank, world, local_rank, device = init_distributed(backend, timeout_s)
    mesh = ParallelDims(dp=world, world_size=world).build(device.type)
    return Context(rank, world, local_rank, device, mesh)


def data_parallel(module: nn.Module, *, algorithm: str = "native", compression: str = "none",
                  bucket_mb: float = 25.0, group: dist.ProcessGroup | None = None,
                  timeout_s: float | None = None) -> DataParallel:
    """Wrap ``module`` (already on its device) in our data parallelism: replicas start from rank 0's weights and
    gradients are averaged during backward. ``algorithm``: "native" (the backend's all-reduce), "auto" (the
    calibrated cost model picks) or one of ours ("ring", "tree", "rabenseifner", "recursive_doubling",
    "hierarchical", "torus", "naive", "star"); ``compression``: "none", "fp16", "bf16", "int8", "topk"."""
    fn = GradientAllReduce(algorithm, compression, timeout_s=timeout_s)
    return DataParallel(module, group=group, bucket_mb=bucket_mb, all_reduce_fn=fn)


def zero(module: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], *, stage: int,
         units: list[nn.Module] | None = None, offload: str = "none", offload_dir: str | None = None,
         bucket_mb: float = 25.0, group: dist.ProcessGroup | None = None,
         device: torch.device | str | None = None) -> tuple[ZeroDataParallel, ZeroOptimizer]:
    """Shard ``module``'s optimizer states (stage 1), gradients (2) and parameters (3) over the data-parallel
    ranks; returns the wrapper (call it like the module) and its optimizer, built by ``make_optimizer(module)``
    (any ``torch.optim`` optimizer with element-wise state, e.g. AdamW; it steps only this rank's slice).

    Stage 3 gathers one *unit* of parameters at a time: ``units`` (default: ``module.blocks``, or else the
    longest ``nn.ModuleList`` in the module, e.g. ``nn.TransformerEncoder.layers``); the rest is one root unit.
    ``offload``: "none", "cpu" or "disk" (master weights and moments; ``offload_dir`` for disk)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage} is not a ZeRO stage; use 1, 2 or 3 (data_parallel for none)")
    if device is not None:
        module = module.to(device)
    if stage == 3 and units is None:
        units = list(getattr(module, "blocks", None) or _longest_module_list(module))
    wrapper = ZeroDataParallel(module, group=group, stage=stage, bucket_mb=bucket_mb, unit_modules=units,
                               offload=offload, offload_dir=offload_dir, device=device)
    return wrapper, ZeroOptimizer(wrapper, make_optimizer(module))


def _longest_module_list(module: nn.Module) -> nn.ModuleList:
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError("zero(stage=3) needs units (the modules gathered one at a time, e.g. the layers); "
                         f"{type(module).__name__} has no .blocks and no nn.ModuleList")
    return max(lists, key=len)


def data_loader(dataset, global_batch: int, ctx: Context, *, shuffle: bool = True, seed: int = 0,
                **loader_kwargs) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over this data-parallel rank's share of a map-style ``dataset``: each step's global batch
    of ``global_batch`` samples is split evenly over the ranks (the tail that fills no batch is dropped). Call
    ``loader.sampler.set_epoch(epoch)`` each epoch for a new order (the same on every rank)."""
    dp = ctx.mesh.dp_size
    if global_batch % dp:
        raise ValueError(f"global_batch={global_batch} does not split over {dp} data-parallel ranks; use a multiple")
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dp, rank=ctx.mesh.dp_rank, shuffle=shuffle,
                                                  seed=seed, drop_last=True)
    return torch.utils.data.DataLoader(dataset, batch_size=global_batch // dp, sampler=sampler, drop_last=True,
                                       **loader_kwargs)


# ---- checkpoints: the single-process state, sharded by who holds it ---------------------------------------


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer, keep: int = 2,
                    extra: dict | None = None) -> None:
    """Write checkpoint ``step`` under ``root`` (``root/step_NNNNNNNN``, atomic, checksummed; the newest ``keep``
    kept). A collective: every rank calls it. ``model``/``optimizer``: a :func:`data_parallel` wrapper (or a plain
    module) and its optimizer, or the pair :func:`zero` returned. ``extra``: JSON-able data (e.g. the epoch)."""
    from shardwise.parallel.zero.checkpoint import zero_checkpoint_pieces, zero_param_groups
    from shardwise.train import state as train_state
    from shardwise.train.sharded import save_sharded, whole

    rank = dist.get_rank()
    if isinstance(model, ZeroDataParallel):
        pieces = zero_checkpoint_pieces(model, optimizer, with_buffers=rank == 0)
        groups = zero_param_groups(optimizer)
    else:
        state = optimizer.state_dict()
        groups = state["param_groups"]
        pieces = []
        if rank == 0:  # replicas are equal: one writes
            pieces = [whole(f"model/{k}", v) for k, v in _inner(model).state_dict().items()]
            pieces += [whole(f"optim/{i}/{k}", v)
                       for i, st in state["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)]
    rng = train_state.gather_rng_states()
    meta = None
    if rank == 0:
        pieces = pieces + train_state.rng_pieces(rng)
        from shardwise.train.optim_state import optimizer_state_to_tensors

        meta = {"step": step, "optimizer": optimizer_state_to_tensors({"state": {}, "param_groups": groups})[1],
                "world_size": dist.get_world_size(), "extra": extra or {}}
    save_sharded(Path(root), step, pieces, meta, keep=keep)


def load_checkpoint(root: str | Path, model: nn.Module, optimizer) -> tuple[int, dict] | None:
    """Load the newest checkpoint under ``root`` that every rank can verify into ``model`` and ``optimizer``
    (resharded to this layout: a data-parallel checkpoint loads under ZeRO and back, on any number of ranks) and
    this rank's RNG; returns ``(step, extra)``, or None when there is none. A collective: the ranks agree on the
    checkpoint, and raise together when there are checkpoints but none verifies on every rank."""
    from shardwise.train.resume import agreed_resume
    from shardwise.train.sharded import materialized_optimizer_state
    from shardwise.train.state import restore_rng

    def load(reader) -> int:
        if isinstance(model, ZeroDataParallel):
            model.load_state_dict(reader.model_state())
            optimizer.load_state_dict(reader.optimizer_state())
        else:
            _inner(model).load_state_dict(dict(reader.model_state()))
            optimizer.load_state_dict(materialized_optimizer_state(reader.optimizer_state()))
        restore_rng(reader, dist.get_rank())
        return int(reader.meta["step"])

    # every rank resumes from the same checkpoint, reading and verifying its share of it (train/resume.py)
    resumed = agreed_resume(Path(root), load, required=False, keep_aside=False,
                            warn=print if dist.get_rank() == 0 else (lambda _m: None))
    if resumed is None:
        return None
    return resumed.step, resumed.reader.meta.get("extra", {})


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, (DataParallel, nn.parallel.DistributedDataParallel)) else model
