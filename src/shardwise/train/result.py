"""What a finished run returns to its caller, whichever runner trained it (tests compare these across layouts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainResult:
    losses: list[float]
    val_loss: float | None
    final_step: int
    state_dict: dict[str, torch.Tensor]
