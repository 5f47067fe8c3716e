"""Parallelism techniques, each applied to a plain model from outside."""

from shardwise.parallel.data import AllReduceFn, DataParallel, broadcast_module, start_native_all_reduce

__all__ = ["AllReduceFn", "DataParallel", "broadcast_module", "start_native_all_reduce"]
