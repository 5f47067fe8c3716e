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
"""

from .allreduce import ALL_REDUCE_ALGORITHMS, all_reduce, native_all_reduce
from .collectives import ALGORITHMS, all_gather, all_to_all, barrier, broadcast, gather, reduce, reduce_scatter, scatter
from .counting import CommLedger, CommStats
from .p2p import OPS

__all__ = ["ALGORITHMS", "ALL_REDUCE_ALGORITHMS", "OPS", "CommLedger", "CommStats", "all_gather", "all_reduce",
           "all_to_all", "barrier", "broadcast", "gather", "native_all_reduce", "reduce", "reduce_scatter", "scatter"]
