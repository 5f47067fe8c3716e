"""What a checkpoint holds for a data-parallel run, and how it is put back.

Tensors (safetensors files): ``model`` (the state dict), ``optimizer`` (flattened AdamW state),
``rng`` (every rank's CPU — and CUDA — generator state). JSON (state.json): the step, the
optimizer's param groups, the loss scaler, the data position and the resolved config.
Resuming restores all of it, so a stopped-and-resumed run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.train.checkpoint import CheckpointError
from shardwise.train.optim_state import optimizer_state_from_tensors, optimizer_state_to_tensors


def gather_rng_states() -> list[torch.Tensor]:
    """Every rank's CPU RNG state (and CUDA, concatenated), gathered on all ranks."""
    state = torch.get_rng_state()
    if torch.cuda.is_available():
        state = torch.cat([state, torch.cuda.get_rng_state()])
    gathered = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, state)
    return gathered


def capture(model_state: dict, optimizer_state: dict, scaler, sampler, step: int, rng_states,
            cfg) -> tuple[dict, dict]:
    """Everything a checkpoint holds: the unsharded model and optimizer state dicts (the engine
    assembles them from shards or stages beforehand), the loss scaler, the data position, RNGs."""
    opt_tensors, opt_meta = optimizer_state_to_tensors(optimizer_state)
    tensors = {
        "model": dict(model_state),
        "optimizer": opt_tensors,
        "rng": {f"rank{r}": s for r, s in enumerate(rng_states)},
    }
    meta = {
        "step": step,
        "optimizer": opt_meta,
        "scaler": scaler.state_dict() if scaler else None,
        "data": sampler.state_dict(step),
        "world_size": dist.get_world_size(),
        "config": cfg.to_dict(),
    }
    return tensors, meta


def restore(tensors: dict, meta: dict, engine, scaler, sampler, rank: int) -> int:
    """Load a captured state into the live engine (model and optimizer), scaler, sampler and RNG;
    returns the step to continue from."""
    engine.load_state(tensors["model"], optimizer_state_from_tensors(tensors["optimizer"], meta["optimizer"]))
    if scaler is not None:
        if meta.get("scaler") is None:
            raise CheckpointError("the checkpoint was not trained with fp16, but train.precision='fp16'")
        scaler.load_state_dict(meta["scaler"])
    sampler.load_state_dict(meta["data"])
    rng = tensors["rng"].get(f"rank{rank}", tensors["rng"]["rank0"])
    n_cpu = torch.get_rng_state().numel()
    torch.set_rng_state(rng[:n_cpu].clone())
    if torch.cuda.is_available() and rng.numel() > n_cpu:
        torch.cuda.set_rng_state(rng[n_cpu:].clone())
    return int(meta["step"])
