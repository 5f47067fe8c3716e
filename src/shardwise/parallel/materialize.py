"""Cut first, allocate after: a model part built on the meta device gets real values only for what this rank keeps.

Tensor and expert parallelism slice the single-device weights (:mod:`shardwise.parallel.tensor.plan`,
:mod:`shardwise.parallel.expert.dispatch`); slicing a meta tensor gives a meta piece, so a part can be built and
cut without memory and only then materialised. Every parameter's value depends only on ``(seed, name, full
shape)`` (:func:`shardwise.model.transformer.initial_value`), so each rank computes the full initial value of one
parameter at a time and keeps its rows (:meth:`~shardwise.parallel.tensor.layers.TPShard.take`), never holding a
whole stage or model -- the meta-device initialisation of FSDP2 (Zhao et al. 2023, "PyTorch FSDP", §3.1), here
for the tensor- and expert-parallel cuts. The values equal those of the single-process model's
``reset_parameters(seed)`` sliced, so every layout still starts from the same model.

Parameters are swapped in place (``torch.utils.swap_tensors``): the Parameter objects and their shard metadata
stay, tied weights stay tied; the gradient hooks the cuts registered (``Tensor.register_hook``, e.g. the
sum over tp of a sequence-parallel norm's gradient) do not survive the swap and are registered again.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.model.layers import RotaryEmbedding
from shardwise.model.router import Router


def init_names(model_cfg) -> dict[str, str]:
    """Every parameter name of ``Transformer(model_cfg)`` (tied weights under each of their names) -> the name its
    initial value is computed from (``named_parameters_for_init``: a tied weight's first name)."""
    from shardwise.model import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    first = {id(p): name for name, p in model.named_parameters_for_init()}
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


@torch.no_grad()
def reset_buffers(part: nn.Module) -> None:
    """Fill the buffers of a part materialised from the meta device (rotary tables, router biases)."""
    for module in part.modules():
        if isinstance(module, (RotaryEmbedding, Router)):
            module.reset_parameters()


@torch.no_grad()
def materialize_parameters(part: nn.Module, model_cfg, seed: int, device: torch.device, values: bool = True) -> int:
    """Give every parameter of ``part`` still on the meta device its value: this rank's rows (per its
    ``ep_shard`` / ``tp_shard``) of the single-process initial value; returns how many were materialised.
    ``values`` False (a pretrained model is loaded over them at once: ``model.init_from``): the pieces are
    allocated and left uninitialised, so no rank computes the full initial value of a tensor it holds a slice of
    (the loader refuses a state that misses any of them)."""
    from shardwise.model.transformer import init_kwargs, initial_value
    from shardwise.parallel.tensor.state import shard_info

    names = init_names(model_cfg)
    done: set[int] = set()
    for name, p in part.named_parameters(remove_duplicate=False):
        if id(p) in done or not p.is_meta:
            continue
        done.add(id(p))
        if values:
            info = shard_info(p)
            full_shape = tuple(info.full_shape) if info is not None else tuple(p.shape)
            value = initial_value(names[_canonical(name)], full_shape, seed, **init_kwargs(model_cfg))
            if info is not None and info.dim is not None:
                value = info.take(value, p.shape[info.dim])
            value = value.to(device=device, dtype=p.dtype)
        else:
            value = torch.empty(p.shape, device=device, dtype=p.dtype)
        new = nn.Parameter(value, requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)  # swap_tensors exchanges the attribute dicts too: keep the metadata
        hooks = list((p._backward_hooks or {}).values())
        torch.utils.swap_tensors(p, new)
        p._backward_hooks = None  # the autograd side of the hooks stayed with the meta tensor: register them again
        for hook in hooks:
            p.register_hook(hook)
    return len(done)


def _canonical(name: str) -> str:
    return ".".join(part for part in name.split(".") if not part.startswith("_"))
