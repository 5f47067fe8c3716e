"""Parallelism techniques, each applied to a plain model from outside.

The names below are imported on first use (:mod:`shardwise.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "AllReduceFn": "shardwise.parallel.data",
    "DataParallel": "shardwise.parallel.data",
    "broadcast_module": "shardwise.parallel.data",
    "start_native_all_reduce": "shardwise.parallel.data",
}

__all__ = [
    "AllReduceFn", "DataParallel", "broadcast_module", "start_native_all_reduce",
]

if TYPE_CHECKING:
    from shardwise.parallel.data import AllReduceFn, DataParallel, broadcast_module, start_native_all_reduce

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
