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
    resume_bytes_read: dict[str, int] = field(default_factory=dict)
    """Bytes this rank read of the checkpoint it resumed from, by file (empty without a resume;
    :class:`shardwise.train.resume.Resumed`)."""
