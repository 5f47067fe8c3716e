"""What a checkpoint holds, and how it is put back.

Tensors (sharded safetensors files, :mod:`shardwise.train.sharded`): the single-process model state dict,
the single-process optimizer's per-parameter state and every rank's CPU (and CUDA) generator state, each
written by the ranks that hold it. JSON (state.json): the step, the optimizer's param groups, the loss
scaler, the data position, the resolved config and the index of the shards. Resuming restores all of
it, so a stopped-and-resumed run is bit-identical to an uninterrupted one, on the same layout or another.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.dist.devices import exchange_device
from shardwise.train.checkpoint import CheckpointError, load_checkpoint, read_state
from shardwise.train.optim_state import optimizer_state_from_tensors, optimizer_state_to_tensors
from shardwise.train.sharded import SHARD_STEM, Piece, ShardedReader, whole


def gather_rng_states() -> list[torch.Tensor]:
    """Every rank's CPU RNG state (and CUDA, concatenated), gathered on all ranks, returned on the CPU.

    The states are host tensors; they travel on the device the default group takes host-side
    exchanges on (the CPU over gloo, also beside nccl; an nccl-only group: the GPU)."""
    state = torch.get_rng_state()
    if torch.cuda.is_available():
        state = torch.cat([state, torch.cuda.get_rng_state()])
    state = state.to(exchange_device())
    gathered = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, state)
    return [g.cpu() for g in gathered]


def rng_pieces(rng_states: list[torch.Tensor]) -> list[Piece]:
    return [whole(f"rng/rank{r}", state) for r, state in enumerate(rng_states)]


def capture_meta(param_groups: list[dict], scaler, sampler, step: int, cfg, skipped_steps: int = 0) -> dict:
    """The JSON part of a checkpoint. ``param_groups`` are the single-process optimizer's groups
    (hyper-parameters and parameter indices); the tensors travel as pieces. ``skipped_steps``: the steps skipped
    before ``step`` (the learning-rate schedule counts only the applied ones, :mod:`shardwise.train.step_guard`)."""
    _, groups_meta = optimizer_state_to_tensors({"state": {}, "param_groups": param_groups})
    return {
        "step": step,
        "skipped_steps": skipped_steps,
        "optimizer": groups_meta,
        "scaler": scaler.state_dict() if scaler else None,
        "data": sampler.state_dict(step),
        "world_size": dist.get_world_size(),
        "config": cfg.to_dict(),
    }


class _WholeFileReader:
    """Checkpoints written before sharding (one ``model``, ``optimizer`` and ``rng`` file) as a reader: every
    file verified and read whole (``bytes_read``: each file's size twice)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tensors, self.meta = load_checkpoint(path)
        self.bytes_read = {p.name: 2 * p.stat().st_size for p in Path(path).iterdir() if p.is_file()}

    def model_state(self) -> dict:
        return self.tensors["model"]

    def optimizer_state(self) -> dict:
        return optimizer_state_from_tensors(self.tensors["optimizer"], self.meta["optimizer"])

    def rng(self, rank: int) -> torch.Tensor:
        return self.tensors["rng"].get(f"rank{rank}", self.tensors["rng"]["rank0"])


def open_checkpoint(path: Path, verify: bool = False, rank: int | None = None, meta: dict | None = None,
                    manifest: dict | None = None):
    """A reader (``model_state()``, ``optimizer_state()``, ``rng(rank)``, ``meta``) of a checkpoint, verified
    before (:func:`~shardwise.train.checkpoint.verify_checkpoint`) or, with ``verify``, tensor by tensor as it
    reads them, preferring ``rank``'s own file where a range is held twice; ``meta`` and ``manifest``: its
    ``state.json`` and manifest when already read."""
    meta = read_state(path) if meta is None else meta
    if "shards" not in meta:
        return _WholeFileReader(path)
    own = None if rank is None else f"{SHARD_STEM.format(rank=rank)}.safetensors"
    return ShardedReader(path, meta, verify=verify, own_file=own, manifest=manifest)


def restore(reader, engine, scaler, sampler, rank: int) -> int:
    """Load a checkpoint into the live engine (model and optimizer, resharded to its layout), scaler,
    sampler and RNG; returns the step to continue from."""
    meta = reader.meta
    engine.load_state(reader.model_state(), reader.optimizer_state())
    if scaler is not None:
        if meta.get("scaler") is None:
            raise CheckpointError("the checkpoint was not trained with fp16, but train.precision='fp16'")
        scaler.load_state_dict(meta["scaler"])
    sampler.load_state_dict(meta["data"])
    restore_rng(reader, rank)
    return int(meta["step"])


def restore_rng(reader, rank: int) -> None:
    """This rank's RNG states as :func:`gather_rng_states` saved them: the CPU's, and the GPU's when both
    the checkpoint and this process have one."""
    rng = reader.rng(rank)
    n_cpu = torch.get_rng_state().numel()
    torch.set_rng_state(rng[:n_cpu].clone())
    if torch.cuda.is_available() and rng.numel() > n_cpu:
        torch.cuda.set_rng_state(rng[n_cpu:].clone())


def checkpoint_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the model tensors a verified checkpoint holds, from its index (``state.json``) or,
    for a whole-file checkpoint, the safetensors header: no tensor is read."""
    meta = read_state(path)
    if "shards" in meta:
        return {k.removeprefix("model/"): tuple(v["shape"]) for k, v in meta["shards"].items()
                if k.startswith("model/")}
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - no __iter__


def resume_mismatch(path: Path, cfg) -> str | None:
    """Why the checkpoint ``path`` cannot be resumed with the (resolved) config ``cfg``, in a few words naming
    a tensor or a field, or None: the model of ``cfg`` (built on the meta device: no memory) must have the
    checkpoint's tensors with their shapes, and fp16 needs the loss scaler's state."""
    from shardwise.model import Transformer

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Transformer(cfg.model).state_dict().items()}
    have = checkpoint_model_shapes(path)
    where = f"checkpoint {path}"
    for name, shape in want.items():
        if name not in have:
            return f"{where} holds no tensor {name!r}, which model.preset={cfg.model.preset!r} has"
        if have[name] != shape:
            return (f"{where} holds {name!r} of shape {list(have[name])}, where model.preset="
                    f"{cfg.model.preset!r} ({cfg.model.flavor}) has {list(shape)}")
    extra = sorted(set(have) - set(want))
    if extra:
        return f"{where} holds {len(extra)} tensor(s) model.preset={cfg.model.preset!r} lacks (e.g. {extra[0]!r})"
    if cfg.train.precision == "fp16" and read_state(path).get("scaler") is None:
        return f"{where} was not trained with fp16 (no loss scaler state), but train.precision='fp16'"
    return None
