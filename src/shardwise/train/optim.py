"""AdamW with decoupled weight decay and a warm-up + cosine learning-rate schedule.

AdamW: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization".
Warm-up then cosine decay to a floor: Loshchilov & Hutter 2017 (SGDR), as used for GPT-3
(Brown et al. 2020, Appendix B). The optimizer itself is torch's; what this module decides is
which parameters decay and what the learning rate is at each step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from shardwise.config import TrainConfig


def decay_groups(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> tuple[list[str], list[str], dict]:
    """``(decayed names, undecayed names, name -> parameter)`` in the optimizer's order.

    Weight decay applies to matrices (linear weights and the token embedding); vectors --
    norm gains and biases -- and the learned position table are not decayed (GPT-2/nanoGPT practice).
    A parameter shared under two names (tied embeddings) counts once, under its first name."""
    decay, no_decay, params = [], [], {}
    seen: set[int] = set()
    for name, param in named_parameters:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        params[name] = param
        matrix = param.dim() >= 2 and "pos_emb" not in name and not name.endswith("bias")  # experts' biases: [E, out]
        (decay if matrix else no_decay).append(name)
    return decay, no_decay, params


def optimizer_param_names(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> list[str]:
    """The parameter names in the order of :func:`build_optimizer`'s state indices (0, 1, ...)."""
    decay, no_decay, _ = decay_groups(named_parameters)
    return decay + no_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig,
                    named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters (or over ``named_parameters`` when given, e.g. the
    chunks a pipeline rank holds), decayed as :func:`decay_groups` says. Fused AdamW when every
    parameter is on a GPU, the foreach implementation otherwise."""
    decay, no_decay, params = decay_groups(model.named_parameters() if named_parameters is None else named_parameters)
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    # on a GPU the fused kernel (one launch per step for all parameters); elsewhere (CPU, or a ZeRO-3
    # model still on the meta device) the multi-tensor one, whose CPU numerics the equivalence tests pin
    fused = bool(params) and all(p.is_cuda for p in params.values())
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             **({"fused": True} if fused else {"foreach": True}))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up over ``warmup_steps``,
    then cosine decay from ``lr`` to ``min_lr`` at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
