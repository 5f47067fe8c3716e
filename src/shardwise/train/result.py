"""What a finished run returns to its caller, whichever runner trained it (tests compare these across layouts)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainResult:
    losses: list[float]
    val_loss: float | None
    final_step: int
    state_dict: dict[str, torch.Tensor]
    grad_norms: list[float] = field(default_factory=list)
    """The pre-clip global gradient norm of every step (empty where the runner has no single global norm: the
    parameter server's workers each measure their own)."""
    skipped_steps: list[int] = field(default_factory=list)
    """The optimizer steps that were skipped on every rank (non-finite loss or gradient, fp16 overflow, a norm
    above ``train.skip_grad_norm_above``; :mod:`shardwise.train.step_guard`), as this rank read them."""
    resume_bytes_read: dict[str, int] = field(default_factory=dict)
    """Bytes this rank read of the checkpoint it resumed from, by file (empty without a resume;
    :class:`shardwise.train.resume.Resumed`)."""
