"""What every worker process of a run executes: the parameter server's workers and servers
(:mod:`shardwise.ps.runner`) when ``ps.servers`` > 0, else the one engine's training loop
(:mod:`shardwise.train.loop`). The launcher, ``torchrun -m shardwise.train`` and the library API start
runs here, so neither runner knows of the other."""

from __future__ import annotations

from pathlib import Path

from shardwise.config import Config
from shardwise.train.result import TrainResult


def train(cfg: Config, run_dir: Path, collect_state: bool = False, stop_after: int | None = None) -> TrainResult:
    """Train ``cfg`` (already resolved) in the current process with the runner its layout needs; the
    arguments are :func:`shardwise.train.loop.train`'s."""
    if cfg.ps.servers:
        from shardwise.ps.runner import run_ps

        return run_ps(cfg, run_dir, collect_state, stop_after)
    from shardwise.train.loop import train as train_engine

    return train_engine(cfg, run_dir, collect_state, stop_after)
