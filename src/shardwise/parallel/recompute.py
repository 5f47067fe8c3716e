"""Activation checkpointing applied from outside the model, full or selective.

* **full** -- Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": keep only each
  checkpointed block's input during forward and recompute its activations in backward.
* **selective** -- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", §5: recompute only the attention core (scores, softmax, dropout, weighted sum of values:
  :meth:`shardwise.model.layers.Attention.core`), whose activations grow with the square of the
  sequence length while its FLOPs are a small part of the layer's; everything else is kept.

Either way a ``forward`` is replaced on the instance (so parameter names and state dicts are
unchanged) by one that runs through ``torch.utils.checkpoint.checkpoint`` (non-reentrant). The
recomputation gets the same arguments, the dropout key among them, so it redraws the same dropout masks
(:mod:`shardwise.model.dropout`; without a key torch's RNG state is restored for the same effect).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "full", "selective")


def apply_recompute(module: nn.Module, mode: str, every: int = 1) -> list[int]:
    """Apply ``mode`` to the transformer blocks inside ``module`` (a whole model or a pipeline stage):
    "full" checkpoints the blocks whose ``layer_id`` is a multiple of ``every`` -- the blocks a single
    process would checkpoint, whichever of them this part holds; "selective" checkpoints the
    attention core of every block. Returns the layer ids touched."""
    from shardwise.model.transformer import Block

    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute={mode!r} is not valid; use one of {', '.join(RECOMPUTE_MODES)}")
    if every < 1:
        raise ValueError(f"every={every} must be >= 1")
    touched = []
    for block in (m for m in module.modules() if isinstance(m, Block)):
        if mode == "full" and block.layer_id % every == 0:
            checkpoint_module(block)
        elif mode == "selective":
            block.attn.core = _checkpointed(block.attn.core)
        else:
            continue
        touched.append(block.layer_id)
    return touched


def checkpoint_module(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them."""
    module.forward = _checkpointed(module.forward)


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
