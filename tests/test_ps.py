"""Parameter server (shardwise.ps): bsp equals synchronous data parallelism, ssp's bound holds, asp runs;
partitions cover the model; failures are reported with the rank, nothing hangs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


def records(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ps" / f"worker{rank}.jsonl").read_text().splitlines()]


def test_ssp_with_zero_staleness_and_full_topk_equal_one_process(one_process, tmp_path, cache_dir):
    """ssp with s = 0 is bsp; top-k compression keeping every entry sends the exact gradient."""
    result = run(tmp_path, cache_dir, "ssp0", 3, **PS, **{"ps.consistency": "ssp", "comm.compression": "topk",
                                                             "comm.topk_ratio": 1.0})
    assert_same_training(result, one_process, atol=1e-5)


def test_asp_with_one_worker_equals_one_process(one_process, tmp_path, cache_dir):
    result = run(tmp_path, cache_dir, "asp1", 2, **PS, **{"ps.consistency": "asp"})
    assert_same_training(result, one_process, atol=1e-5)


def test_ssp_bound_holds_under_a_straggler(tmp_path, cache_dir):
    """No pull is staler than s, the fast worker reaches s, and the slow one is never ahead of its reads."""
    s = 2
    run(tmp_path, cache_dir, "ssp2", 3, **PS, **{"ps.consistency": "ssp", "ps.staleness": s, "ps.straggler": "1:150"})
    fast, slow = records(tmp_path / "ssp2", 0), records(tmp_path / "ssp2", 1)
    seen = [r["ps_staleness"] for r in fast + slow]
    assert max(seen) <= s, seen
    assert max(r["ps_staleness"] for r in fast) == s, "the fast worker should run s clocks ahead of the straggler"
    assert fast[-1]["ps_wait_s"] >= 0 and fast[-1]["ps_staleness_max"] == s
    server = json.loads((tmp_path / "ssp2" / "ps" / "server2.json").read_text())
    assert server["max_staleness_served"] <= s and server["updates"] == 10  # one update per complete clock


def test_asp_with_a_straggler_and_int8_pushes_trains(tmp_path, cache_dir):
    """asp: every push applied on arrival (2 workers x 10 clocks), no crash, loss falls; bytes counted."""
    losses, state = run(tmp_path, cache_dir, "asp", 3, **PS, **{"ps.consistency": "asp", "ps.straggler": "1:100",
                                                                  "comm.compression": "int8"})
    assert all(torch.isfinite(v).all() for v in state.values())
    assert losses[-1] < losses[0]
    server = json.loads((tmp_path / "asp" / "ps" / "server2.json").read_text())
    assert server["updates"] == 20 and server["pushes_received"] > 0
    fast = records(tmp_path / "asp", 0)
    assert max(r["ps_staleness"] for r in fast) >= 1, "the fast worker should read weights lacking the straggler's"
    n_params = sum(v.numel() for k, v in state.items() if k != "lm_head.weight" and v.is_floating_point())
    pushed = fast[3]["ps_bytes_pushed"]
    assert n_params * 1.0 < pushed < n_params * 1.2, "int8 pushes carry about a byte per value"
    assert fast[3]["ps_bytes_pulled"] >= 4 * n_params * 0.9
