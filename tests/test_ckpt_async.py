"""Asynchronous checkpoints (``ckpt.async``): what they hold, resumed bit-identically, pruned to ``ckpt.keep``, their
stall and write times measured, a failed background write raised in one line with nothing left behind. (A crash
during the background write: tests/test_failover.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.train.checkpoint import list_checkpoints
from shardwise.train.state import open_checkpoint
from tests.harness import run_on_ranks
from tests.test_train import run

ASYNC = {"ckpt.every": 2, "ckpt.keep": 2, "ckpt.async": "true", "train.steps": 6}


@pytest.mark.parametrize("zero", [0, 3], ids=["dp", "zero3"])
def test_async_checkpoints_hold_the_state_and_resume_bit_identically(tmp_path, cache_dir, zero):
    """The background writes hold what a synchronous save holds (the newest checkpoint, of the last step, is the
    final model; a run stopped after step 3 resumes from checkpoint 2 to the same bits), ckpt.keep prunes them,
    and the trainer measures each checkpoint's stall and write. ZeRO-3 hands the writer its shard's own storage
    (no copy at the checkpoint step): the writer's copy must be done before the next update changes it."""
    full = run(tmp_path, cache_dir, "async", 2, **ASYNC, **{"parallel.zero": zero})
    saved = list_checkpoints(tmp_path / "async" / "checkpoints")
    assert [p.name for p in saved] == ["step_00000004", "step_00000006"]  # ckpt.keep
    model = open_checkpoint(saved[-1]).model_state()
    for key, value in full[1].items():
        assert torch.equal(model[key], value), key
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    stalls = [r["step"] for r in rows if "ckpt_stall_s" in r]
    writes = [r["ckpt_write_s"] for r in rows if "ckpt_write_s" in r]
    assert stalls == [2, 4, 6] and len(writes) == 3 and all(w > 0 for w in writes)

    run(tmp_path, cache_dir, "resumed", 2, stop_after=3, **ASYNC, **{"parallel.zero": zero})
    assert [p.name for p in list_checkpoints(tmp_path / "resumed" / "checkpoints")] == ["step_00000002"]
    resumed = run(tmp_path, cache_dir, "resumed", 2, **ASYNC, **{"ckpt.resume": "true", "parallel.zero": zero})
    assert resumed[0] == full[0][2:]
    for key, value in full[1].items():
        assert torch.equal(value, resumed[1][key]), key


def _failing_write(root: str):
    """Rank 1 hands the writer a tensor safetensors cannot store: every rank learns it at its next wait, rank 0
    removes the temporary directory."""
    import torch.distributed as dist

    from shardwise.train.checkpoint import CheckpointError
    from shardwise.train.ckpt_writer import CheckpointWriter
    from shardwise.train.sharded import Piece

    writer = CheckpointWriter(Path(root), keep=2, background=True, timeout_s=60)
    bad = torch.eye(3).to_sparse() if dist.get_rank() == 1 else torch.ones(3)
    writer.save(1, [Piece(f"model/x{dist.get_rank()}", bad, 0, (3, 3))], {"step": 1} if dist.get_rank() == 0 else None)
    try:
        writer.wait()
    except CheckpointError as e:
        return str(e)
    return None


def test_a_failed_background_write_is_raised_in_one_line_and_leaves_nothing(tmp_path):
    errors = run_on_ranks(2, _failing_write, str(tmp_path / "ckpt"))
    for e in errors:
        assert e is not None and e.startswith("checkpoint step 1 was not written: rank 1: "), e
        assert "\n" not in e
    assert list((tmp_path / "ckpt").iterdir()) == []


def _update_waits_for_the_copy(root: str):
    """The background copy is held back; an optimizer step (``before_update``) must wait for it, so the checkpoint
    holds the values of its step although training changes them right after."""
    import threading

    import torch.distributed as dist

    import shardwise.train.ckpt_writer as ckpt_writer
    from shardwise.train.sharded import Piece
    from shardwise.train.state import open_checkpoint

    gate, real = threading.Event(), ckpt_writer.host_copy
    ckpt_writer.host_copy = lambda pieces, *more: (gate.wait(), real(pieces, *more))[1]
    try:
        writer = ckpt_writer.CheckpointWriter(Path(root), keep=2, background=True, timeout_s=60)
        weight = torch.zeros(4)
        rank = dist.get_rank()
        writer.save(1, [Piece(f"model/w{rank}", weight, 0, (4,))], {"step": 1} if rank == 0 else None)
        updated = threading.Event()
        step = threading.Thread(target=lambda: (writer.before_update(), weight.add_(1), updated.set()))
        step.start()
        blocked = not updated.wait(0.5)  # can only pass wrongly (a slow start), never fail wrongly
        gate.set()
        step.join()
        writer.wait()
    finally:
        ckpt_writer.host_copy = real
    dist.barrier()
    saved = open_checkpoint(Path(root) / "step_00000001").model_state()
    return blocked, [saved[f"w{r}"].tolist() for r in range(dist.get_world_size())], weight.tolist()


def test_the_next_update_waits_for_the_background_copy(tmp_path):
    for blocked, saved, now in run_on_ranks(2, _update_waits_for_the_copy, str(tmp_path / "ckpt")):
        assert blocked and saved == [[0.0] * 4] * 2 and now == [1.0] * 4


@pytest.mark.parametrize("over,fragment", [
    ({"ckpt.async": "true", "ps.servers": "1"}, "ckpt.async=true with ps.servers=1: the parameter server's"),
])
def test_async_is_refused_where_it_is_not_composed(over, fragment):
    from shardwise.config import Config, ConfigError
    from shardwise.config_resolve import resolve

    with pytest.raises(ConfigError, match="^" + fragment):
        resolve(Config.load(overrides={"parallel.nproc": "2", **over}), tokenizer_vocab=257)
