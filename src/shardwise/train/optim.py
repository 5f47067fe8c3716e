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
    chunks a pipeline rank holds), decayed as :func:`decay_groups` says. torch's fused AdamW (one kernel for
    every parameter, on GPUs and CPUs): it takes a learning rate and a skip flag that are tensors on the
    device (``found_inf``, as ``torch.amp.GradScaler`` hands it), so a step is applied or skipped, and its
    learning rate chosen, without the host reading anything (:mod:`shardwise.train.step_guard`). (A ZeRO-3
    model still on the meta device gets the same settings; :class:`~shardwise.parallel.zero.ZeroOptimizer`
    steps its slices.)"""
    decay, no_decay, params = decay_groups(model.named_parameters() if named_parameters is None else named_parameters)
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up over ``warmup_steps``,
    then cosine decay from ``lr`` to ``min_lr`` at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float | torch.Tensor) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class DeviceLrSchedule:
    """:func:`lr_at` of the steps applied so far, chosen on the device.

    A skipped step does not advance the schedule (torchtitan and Megatron-LM step their schedulers only after
    an applied update): step ``s`` trains with ``lr_at(s - skipped)``, ``skipped`` being the count of skipped
    steps before it -- a tensor on the device, so the host never reads it. The values are :func:`lr_at`'s own,
    tabulated once (float64 on the host's side of the kernel: the CPU's fused AdamW reads a float64 scalar, as
    from a Python float; fp32 on a GPU, whose fused kernel reads an fp32 learning rate and computed in fp32
    from a Python float as well)."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.table = torch.tensor([lr_at(s, cfg) for s in range(cfg.steps)], dtype=torch.float64, device=device)
        self.lr = torch.zeros((), dtype=torch.float32 if device.type == "cuda" else torch.float64, device=device)
        """The learning rate the optimizer's groups hold: a tensor on the device, refilled every step."""

    def set(self, optimizer: torch.optim.Optimizer, step: int, skipped: torch.Tensor) -> torch.Tensor:
        """Put step ``step``'s learning rate into ``optimizer`` given ``skipped`` (a 0-dim device tensor, the
        skipped steps before it); returns it (float64, for the metrics)."""
        index = (step - skipped.long()).clamp_(0, self.table.numel() - 1).reshape(1)
        lr = self.table.index_select(0, index).reshape(())
        self.lr.copy_(lr)
        set_lr(optimizer, self.lr)
        return lr
