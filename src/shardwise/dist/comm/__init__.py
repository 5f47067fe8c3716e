"""Collective communication written on point-to-point messages, a cost model that chooses
among the algorithms, and gradient compression for data-parallel training.

Modules:
    p2p          the ``Comm`` view of a group, chunked isend/irecv, reductions, metadata check
    primitives   ring / halving-doubling / binomial-tree / chain building blocks
    allreduce    every all-reduce algorithm and ``all_reduce(tensor, op, group, algorithm)``
    collectives  reduce-scatter, all-gather, broadcast, reduce, gather, scatter, all-to-all, barrier
    cost         alpha-beta-gamma formulas, ``calibrate(group)``, ``choose(collective, bytes, ...)``
    counting     the counting layer: bytes handed to collectives and sent, per mesh axis (CommLedger)
    compress     top-k / int8 / fp16 / bf16 gradient all-reduce for DataParallel (error feedback)
    background   the communication thread that lets blocking algorithms overlap backward
    bench        ``shardwise bench comm``

The names below are imported on first use (:mod:`shardwise.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "ALGORITHMS": "shardwise.dist.comm.collectives",
    "ALL_REDUCE_ALGORITHMS": "shardwise.dist.comm.allreduce",
    "CommLedger": "shardwise.dist.comm.counting",
    "CommStats": "shardwise.dist.comm.counting",
    "OPS": "shardwise.dist.comm.p2p",
    "all_gather": "shardwise.dist.comm.collectives",
    "all_reduce": "shardwise.dist.comm.allreduce",
    "all_to_all": "shardwise.dist.comm.collectives",
    "barrier": "shardwise.dist.comm.collectives",
    "broadcast": "shardwise.dist.comm.collectives",
    "gather": "shardwise.dist.comm.collectives",
    "native_all_reduce": "shardwise.dist.comm.allreduce",
    "reduce": "shardwise.dist.comm.collectives",
    "reduce_scatter": "shardwise.dist.comm.collectives",
    "scatter": "shardwise.dist.comm.collectives",
}

__all__ = [
    "ALGORITHMS", "ALL_REDUCE_ALGORITHMS", "CommLedger", "CommStats", "OPS", "all_gather", "all_reduce",
    "all_to_all", "barrier", "broadcast", "gather", "native_all_reduce", "reduce", "reduce_scatter", "scatter",
]

if TYPE_CHECKING:
    from shardwise.dist.comm.allreduce import ALL_REDUCE_ALGORITHMS, all_reduce, native_all_reduce
    from shardwise.dist.comm.collectives import ALGORITHMS, all_gather, all_to_all, barrier, broadcast, gather, reduce, reduce_scatter, scatter
    from shardwise.dist.comm.counting import CommLedger, CommStats
    from shardwise.dist.comm.p2p import OPS

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
