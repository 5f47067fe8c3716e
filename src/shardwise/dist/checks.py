"""The config rules of the process groups and the launch (timeouts, several machines), functions of the
config alone (no torch)."""

from __future__ import annotations

from shardwise.checks import Unused, positive
from shardwise.config import Config


def check(cfg: Config) -> None:
    p = cfg.parallel
    positive("parallel.bucket_mb", p.bucket_mb)
    positive("parallel.timeout_s", p.timeout_s)
    positive("parallel.rdzv_timeout_s", p.rdzv_timeout_s)


def unused(cfg: Config) -> list[Unused]:
    nodes = cfg.parallel.nnodes > 1
    return [
        Unused("parallel.rdzv_endpoint", nodes, "is where the nodes of a multi-node run meet, but "
               "parallel.nnodes=1; set parallel.nnodes or remove it"),
        Unused("parallel.rdzv_timeout_s", nodes, "bounds the rendezvous of a multi-node run, but "
               "parallel.nnodes=1; set parallel.nnodes or remove it"),
    ]
