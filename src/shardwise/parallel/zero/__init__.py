"""ZeRO (Rajbhandari et al. 2020): sharded optimizer states (stage 1), gradients (2) and
parameters (3), with CPU and disk offload of the master weights and optimizer states.

``ZeroDataParallel`` shards a model over a data-parallel group; ``ZeroOptimizer`` steps the
rank's slice with the algorithm of a reference (unsharded) optimizer.
"""

from shardwise.parallel.zero.consolidate import full_model_state, load_full_model_state
from shardwise.parallel.zero.offload import OFFLOADS, MasterStore
from shardwise.parallel.zero.optim import ZeroOptimizer
from shardwise.parallel.zero.wrapper import ZeroDataParallel

__all__ = ["OFFLOADS", "MasterStore", "ZeroDataParallel", "ZeroOptimizer", "full_model_state",
           "load_full_model_state"]
