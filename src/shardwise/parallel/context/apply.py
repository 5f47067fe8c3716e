"""Context parallelism applied from outside to a plain model part (step 2 of
:func:`shardwise.parallel.parallelize.parallelize`): every :class:`~shardwise.model.layers.Attention`'s
core becomes a :class:`.core.ContextAttention` over the ``cp`` axis, positions (learned or rotary) are
looked up at the global positions of this rank's tokens, and the loss becomes the mean over the whole
sequence (:class:`.core.ContextParallelLoss`). The tokens and labels themselves are cut by the data
path (:func:`.layout.shard_windows`), the same cut for both."""

from __future__ import annotations

from torch import nn

from shardwise.dist.comm.counting import CommStats
from shardwise.parallel.context.core import ContextAttention, ContextParallelLoss
from shardwise.parallel.context.layout import SequenceLayout, use_global_positions


def apply_context_parallel(part: nn.Module, mesh, cfg, stats: CommStats | None = None) -> ContextAttention:
    """Rewrite ``part`` (a Transformer or a pipeline stage of one) in place for this rank's cp shard;
    returns the shared attention core (its ``work`` counter is this part's attention work)."""
    from shardwise.model.layers import Attention

    p = cfg.parallel
    layout = SequenceLayout(mesh.size("cp"), mesh.rank("cp"), p.cp_balance)
    core = ContextAttention(p.cp_algorithm, layout, mesh.group("cp"), mesh.ranks("cp"), stats,
                            causal=cfg.model.flavor != "bert")
    for m in part.modules():
        if isinstance(m, Attention):
            m.core = core
    use_global_positions(part, layout)
    if hasattr(part, "loss_fn"):
        part.loss_fn = ContextParallelLoss(part.loss_fn, mesh.group("cp"), layout.cp, stats)
    return core
