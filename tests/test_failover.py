"""Failover: a worker killed (or hung) mid-run, torch's elastic agent restarts the group, the run resumes
from the newest checkpoint that verifies and ends bit-identical to an uninterrupted run.

Each case is one real launch (`shardwise train` -> elastic agent -> 2 workers, restarted by the agent),
with failures injected by ``run.fault`` (train/faults.py); the uninterrupted reference runs in the
reusable gloo worker pool. Few and tiny: each launch costs a few worker start-ups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.train.checkpoint import list_checkpoints
from shardwise.train.metrics import read_metrics
from shardwise.train.recovery import failures
from shardwise.train.state import open_checkpoint
from tests.test_train import make_config, run

STEPS, EVERY = 8, 2


def _launch(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """`shardwise train RUN_DIR/config.toml ...` as a user runs it (one thread per worker, as the pool)."""
    cmd = [sys.executable, "-m", "shardwise.cli", "train", str(run_dir / "config.toml"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


def _killed_run_matches_uninterrupted(tmp_path, cache_dir, fault: str, max_lost: int = EVERY, **layout):
    """Launch with ``fault``; return (metrics records, console text) after checking the final weights
    against an uninterrupted run of the same seed and layout (and that at most ``max_lost`` steps were lost)."""
    overrides = {"train.steps": STEPS, "ckpt.every": EVERY, "ckpt.keep": 2, **layout}
    _, reference, _ = run(tmp_path, cache_dir, "reference", 2, **overrides)
    run_dir = tmp_path / "killed"
    make_config(run_dir, cache_dir, 2, **overrides)  # writes run_dir/config.toml
    proc = _launch(run_dir, "--run.fault", fault)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert newest.name == f"step_{STEPS:08d}"
    model = open_checkpoint(newest).model_state()
    for name, value in reference.items():
        assert torch.equal(model[name], value), f"{name} differs from the uninterrupted run"
    raw = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    restarts = [r for r in raw if "restart" in r]
    assert [r["restart"] for r in restarts] == list(range(1, len(fault.split(",")) + 1))
    assert all(0 <= r["steps_lost"] <= max_lost for r in restarts), restarts
    timeline = read_metrics(run_dir)
    assert [r["step"] for r in timeline if "loss" in r] == list(range(1, STEPS + 1)), "one record per step"
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    return restarts, proc.stdout, run_dir


def test_data_parallel_survives_a_kill_and_a_kill_while_saving(tmp_path, cache_dir):
    """dp 2: rank 1 SIGKILLed after step 3 (checkpoint 2 exists: 1 step lost), then in the next attempt
    rank 0 SIGKILLed while writing checkpoint 6 (its partial directory is never chosen; the third
    attempt resumes from 4 and removes it)."""
    restarts, out, _ = _killed_run_matches_uninterrupted(tmp_path, cache_dir, "kill@3:r1,save@6:r0")
    assert [(r["resumed_step"], r["steps_lost"]) for r in restarts] == [(2, 1), (4, 2)]
    assert "removed 1 partial checkpoint(s) left by a failed write: .tmp-step_00000006-" in out
    assert "restart 1 of 3: resumed at step 2, 1 step(s) lost" in out


def test_a_crash_during_a_background_checkpoint_write_keeps_the_previous_one(tmp_path, cache_dir):
    """ZeRO-3 with ckpt.async: rank 1 is SIGKILLed by its writer thread after writing its shard of checkpoint 6, while
    training goes on; checkpoint 6 never becomes valid (no manifest, no rename), so the restart resumes from 4 (each
    rank reading its shard), removes the partial directory, and the run ends bit-identical to an uninterrupted one
    with ckpt.keep's 2 checkpoints. The steps trained while checkpoint 6 was being written are lost too: up to
    2 x ckpt.every."""
    restarts, out, run_dir = _killed_run_matches_uninterrupted(tmp_path, cache_dir, "save@6:r1", max_lost=2 * EVERY,
                                                               **{"ckpt.async": "true", "parallel.zero": 3})
    assert [r["resumed_step"] for r in restarts] == [4]
    assert "removed 1 partial checkpoint(s) left by a failed write: .tmp-step_00000006-" in out
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000006", "step_00000008"]


def test_pipeline_survives_a_stopped_stage(tmp_path, cache_dir):
    """pp 2: stage 1 is stopped (SIGSTOP) after step 4 is logged, before checkpoint 4 (so checkpoint 2 is the newest: 2
    steps lost); stage 0's next transfer times out after parallel.timeout_s, the error names the
    collective and the rank that did not answer, and the agent restarts the group (SIGKILLing the stopped
    process, which cannot act on SIGTERM)."""
    restarts, _, run_dir = _killed_run_matches_uninterrupted(
        tmp_path, cache_dir, "stop@4:r1", **{"parallel.pp": 2, "parallel.timeout_s": 8})
    assert [(r["resumed_step"], r["steps_lost"]) for r in restarts] == [(2, 2)]
    (failure,) = failures(run_dir, 0)
    assert failure["rank"] == 0 and "ranks not answering: [1]" in failure["error"], failure
    assert restarts[0]["cause"].startswith("rank 0: ") and "failed on rank 0" in restarts[0]["cause"]
    assert "Timed out" in failure["error"] and "(" in failure["error"].split(" failed")[0], "names the call site"


def test_a_failure_that_repeats_is_not_retried(tmp_path, cache_dir):
    """The same error on the same rank ends attempts 0 and 1 (``raise@1:r1`` twice): attempt 2 finds it twice in
    failures.jsonl, every worker stops before training, and the launch fails with one line naming the rank and
    the error -- instead of burning the remaining restarts on a failure that is not transient."""
    run_dir = tmp_path / "repeat"
    make_config(run_dir, cache_dir, 2, **{"train.steps": 3, "run.max_restarts": 3})
    proc = _launch(run_dir, "--run.fault", "raise@1:r1,raise@1:r1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank 1 failed the same way in attempts 0 and 1" in out and "injected error after step 1 on rank 1" in out
    assert {r["attempt"] for r in failures(run_dir)} == {0, 1}, "no attempt after the one that gave up trained"


@pytest.mark.parametrize(("fault", "fragment"), [
    ("kill@3", "is not KIND@STEP:rRANK"),
    ("boom@3:r0", "is not KIND@STEP:rRANK"),
    ("kill@3:r2", "rank 2 does not exist in a world of 2"),
    ("kill@99:r0", "step 99 is not among the run's steps 1..10"),
    ("kill@1:r0,kill@2:r0,kill@3:r0,kill@4:r0,kill@5:r0", "allows 4 attempts"),
])
def test_bad_fault_specs_are_refused_in_one_line(fault, fragment):
    from shardwise.config import Config, ConfigError
    from shardwise.config_resolve import resolve

    cfg = Config.load(overrides={"parallel.nproc": "2", "train.steps": "10", "run.fault": fault})
    with pytest.raises(ConfigError, match="run.fault=") as e:
        resolve(cfg, tokenizer_vocab=257)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_max_restarts_defaults_to_three_when_checkpoints_are_written():
    from shardwise.config import Config
    from shardwise.config_resolve import resolve

    def resolved(**o):
        return resolve(Config.load(overrides={"parallel.nproc": "2", **o}), tokenizer_vocab=257).run.max_restarts

    assert (resolved(), resolved(**{"ckpt.every": "0"}), resolved(**{"run.max_restarts": "1"})) == (3, 0, 1)


def _hung_peer(port: int, algorithm: str):
    """Rank 1 never joins an all-reduce on a group with a 1.5 s timeout (ours: comm's timeout_s); rank 0's
    error names the collective and rank 1 (roll call on a store only rank 0 writes to)."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from shardwise.dist.comm import all_reduce
    from shardwise.dist.diagnose import describe

    group = dist.new_group([0, 1], timeout=timedelta(seconds=1.5))
    if dist.get_rank() == 1:
        time.sleep(2.0)  # hung: past rank 0's timeout
        return None
    store = dist.TCPStore("127.0.0.1", port, world_size=1, is_master=True, wait_for_workers=False)
    try:
        if algorithm == "backend":
            dist.all_reduce(torch.ones(4), group=group)
        else:
            all_reduce(torch.ones(4), group=group, algorithm=algorithm, verify=False, timeout_s=1.5)
    except (RuntimeError, TimeoutError) as e:
        return describe(e, 0, 2, wait_s=0.3, store=store)
    return "no error"


@pytest.mark.parametrize(("algorithm", "name"), [("backend", "all_reduce"), ("ring", "all_reduce/ring")])
def test_a_hung_peer_is_named_with_the_collective(algorithm, name):
    from shardwise.dist.mesh import free_port
    from tests.harness import run_on_ranks

    line = run_on_ranks(2, _hung_peer, free_port(), algorithm)[0]
    assert line.startswith(f"{name} failed on rank 0: ranks not answering: [1]; backend: "), line
    assert "imed out" in line and "\n" not in line
