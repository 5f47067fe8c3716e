"""AdamW with decoupled weight decay and a warm-up + cosine learning-rate schedule.

AdamW: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization".
Warm-up then cosine decay to a floor: Loshchilov & Hutter 2017 (SGDR), as used for GPT-3
(Brown et al. 2020, Appendix B). The optimizer itself is torch's; what this module decides is
which parameters decay and what the learning rate is at each step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters.

    Weight decay applies to matrices (linear weights and the token embedding); vectors —
    norm gains and biases — and the learned position table are not decayed (GPT-2/nanoGPT practice).
    """
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.dim() >= 2 and "pos_emb" not in name else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


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
