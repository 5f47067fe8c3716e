"""Activation checkpointing applied from outside the model.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": keep only each checkpointed
block's input during forward and recompute its activations in backward. Here a block's
``forward`` is replaced (on the instance, so parameter names and state dicts are unchanged)
by one that runs through ``torch.utils.checkpoint.checkpoint`` (non-reentrant; the RNG state is
restored for the recomputation so dropout masks match).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(blocks: nn.ModuleList, every: int = 1) -> list[int]:
    """Checkpoint every ``every``-th block of ``blocks`` (indices 0, every, 2*every, ...).

    ``every=1`` is full recomputation. Returns the indices of the checkpointed blocks.
    """
    if every < 1:
        raise ValueError(f"every={every} must be >= 1")
    chosen = list(range(0, len(blocks), every))
    for i in chosen:
        checkpoint_module(blocks[i])
    return chosen


def checkpoint_module(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them."""
    module.forward = _checkpointed(module.forward)


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
