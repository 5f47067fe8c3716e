"""The layer directly over torch.distributed: process groups and named parallel axes."""

from shardwise.dist.mesh import (
    ALL_AXES,
    AXES,
    Mesh,
    ParallelDims,
    free_port,
    init_distributed,
    resolve_backend,
    shutdown_distributed,
)

__all__ = [
    "ALL_AXES", "AXES", "Mesh", "ParallelDims", "free_port", "init_distributed", "resolve_backend",
    "shutdown_distributed",
]
