"""The layer directly over torch.distributed: process groups and named parallel axes.

The names below are imported on first use (:mod:`shardwise.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "ALL_AXES": "shardwise.dist.mesh",
    "AXES": "shardwise.dist.mesh",
    "Mesh": "shardwise.dist.mesh",
    "ParallelDims": "shardwise.dist.mesh",
    "free_port": "shardwise.dist.mesh",
    "init_distributed": "shardwise.dist.mesh",
    "resolve_backend": "shardwise.dist.mesh",
    "shutdown_distributed": "shardwise.dist.mesh",
}

__all__ = [
    "ALL_AXES", "AXES", "Mesh", "ParallelDims", "free_port", "init_distributed", "resolve_backend",
    "shutdown_distributed",
]

if TYPE_CHECKING:
    from shardwise.dist.mesh import ALL_AXES, AXES, free_port, init_distributed, resolve_backend, shutdown_distributed, Mesh, ParallelDims

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
