"""Parameter server (shardwise.ps): bsp equals synchronous data parallelism, ssp's bound holds, asp runs;
partitions cover the model; failures are reported with the rank, nothing hangs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_on_ranks
from tests.test_train import assert_same_training, make_config

PS = {"ps.servers": 1}


def _train(cfg, run_dir: str, stop_after=None):
    import torch.distributed as dist

    from shardwise.train.loop import train

    result = train(cfg, Path(run_dir), collect_state=True, stop_after=stop_after)
    return (result.losses, result.state_dict) if dist.get_rank() == 0 else None


def run(tmp_path: Path, cache_dir: Path, name: str, nproc: int, stop_after=None, timeout=120, **overrides):
    run_dir = tmp_path / name
    cfg = make_config(run_dir, cache_dir, nproc, **overrides)
    return run_on_ranks(nproc, _train, cfg, str(run_dir), stop_after, timeout=timeout)[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache_dir):
    return run(tmp_path_factory.mktemp("ref"), cache_dir, "dp1", 1)


@pytest.mark.parametrize("servers", [1, 2])
def test_bsp_equals_one_process(one_process, tmp_path, cache_dir, servers):
    """bsp with 2 workers and S servers trains the model one process trains with the same global batch."""
    result = run(tmp_path, cache_dir, "bsp", 2 + servers, **{"ps.servers": servers, "ps.partition_kb": 8})
    assert_same_training(result, one_process, atol=1e-5)
