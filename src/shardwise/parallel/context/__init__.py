"""Context parallelism: the sequence of every layer split over the ``cp`` axis.

* :mod:`.layout` -- head-tail load-balanced split of tokens, labels and positions;
* :mod:`.blocks`, :mod:`.partial` -- blockwise attention and its log-sum-exp merge;
* :mod:`.ring` -- ring attention (Liu et al. 2023); :mod:`.allgather` -- all-gather K/V;
  :mod:`.ulysses` -- DeepSpeed-Ulysses all-to-all (Jacobs et al. 2023);
* :mod:`.core` -- the swapped attention core, its work counter and the whole-sequence loss;
* :mod:`.apply` -- :func:`apply_context_parallel`, step 2 of ``parallelize``.

The names below are imported on first use (:mod:`shardwise.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "ALGORITHMS": "shardwise.parallel.context.core",
    "BALANCES": "shardwise.parallel.context.layout",
    "ContextAttention": "shardwise.parallel.context.core",
    "SequenceLayout": "shardwise.parallel.context.layout",
    "apply_context_parallel": "shardwise.parallel.context.apply",
    "pop_attention_work": "shardwise.parallel.context.core",
    "shard_windows": "shardwise.parallel.context.layout",
}

__all__ = [
    "ALGORITHMS", "BALANCES", "ContextAttention", "SequenceLayout", "apply_context_parallel",
    "pop_attention_work", "shard_windows",
]

if TYPE_CHECKING:
    from shardwise.parallel.context.apply import apply_context_parallel
    from shardwise.parallel.context.core import ALGORITHMS, ContextAttention, pop_attention_work
    from shardwise.parallel.context.layout import BALANCES, SequenceLayout, shard_windows

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
