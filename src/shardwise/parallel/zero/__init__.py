"""ZeRO (Rajbhandari et al. 2020): sharded optimizer states (stage 1), gradients (2) and
parameters (3), with CPU and disk offload of the master weights and optimizer states.

``ZeroDataParallel`` shards a model over a data-parallel group; ``ZeroOptimizer`` steps the
rank's slice with the algorithm of a reference (unsharded) optimizer.

The names below are imported on first use (:mod:`shardwise.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "MasterStore": "shardwise.parallel.zero.offload",
    "OFFLOADS": "shardwise.parallel.zero.offload",
    "ZeroDataParallel": "shardwise.parallel.zero.wrapper",
    "ZeroOptimizer": "shardwise.parallel.zero.optim",
    "full_model_state": "shardwise.parallel.zero.consolidate",
    "load_full_model_state": "shardwise.parallel.zero.consolidate",
}

__all__ = [
    "MasterStore", "OFFLOADS", "ZeroDataParallel", "ZeroOptimizer", "full_model_state", "load_full_model_state",
]

if TYPE_CHECKING:
    from shardwise.parallel.zero.consolidate import full_model_state, load_full_model_state
    from shardwise.parallel.zero.offload import OFFLOADS, MasterStore
    from shardwise.parallel.zero.optim import ZeroOptimizer
    from shardwise.parallel.zero.wrapper import ZeroDataParallel

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
