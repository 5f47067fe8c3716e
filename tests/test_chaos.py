"""The pieces of the fault-injection soak (``scripts/chaos.py``, minutes: run by hand, its figures in the
README): random faults that really fire, the check of a faulted run, and a disk that fills while a checkpoint
is written (a small tmpfs; skipped, with the reason, where mounting is not allowed)."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
import torch

from shardwise.train.faults import FAILURES, draw_faults, parse_faults, resumed_after
from tests.harness import run_on_ranks


def test_drawn_faults_fire_in_their_attempts():
    """Every drawn fault is at a step its attempt reaches (after the checkpoint the attempt resumed from),
    ``save`` only where a checkpoint is written, and no rank leaves the same kind of error two attempts in
    a row (the launcher would call that a bug and stop restarting)."""
    rng, seen = random.Random(7), set()
    for _ in range(200):
        world = rng.choice([2, 4])
        faults = draw_faults(rng, 4, steps=8, every=2, world=world)
        assert len(faults) == 4
        parse_faults(",".join(f"{f.kind}@{f.step}:r{f.rank}" for f in faults), world=world, steps=8)
        resumed, prev = 0, None
        for f in faults:
            seen.add(f.kind)
            assert resumed < f.step <= 8 and 0 <= f.rank < world, (faults, f)
            assert f.kind != "save" or f.step % 2 == 0
            if prev is not None and {prev.kind, f.kind} <= {"stop", "hang", "raise"}:
                assert prev.rank != f.rank, faults
            resumed, prev = resumed_after(f, resumed, 2), f
    assert seen == set(FAILURES)
    assert resumed_after(parse_faults("kill@5:r0")[0], 2, 2) == 4  # checkpoint 4 done, 5 was not due
    assert resumed_after(parse_faults("save@6:r0")[0], 2, 2) == 4  # checkpoint 6 died while written


def _fill_the_disk(root: str):
    """Rank body: a checkpoint that fits, one that does not (the tmpfs fills while the shards are written),
    and one whose finish fails on rank 0 alone (state that is not JSON); what each rank raised."""
    import torch.distributed as dist

    from shardwise.train.checkpoint import CheckpointError
    from shardwise.train.sharded import save_sharded, whole

    rank, out = dist.get_rank(), []
    for step, numel, meta in ((1, 40_000, {"step": 1}), (2, 150_000, {"step": 2}), (3, 10, {"step": object()})):
        try:
            save_sharded(Path(root), step, [whole(f"w{rank}", torch.zeros(numel))], meta if rank == 0 else None, 3)
            out.append(None)
        except CheckpointError as e:
            out.append(str(e))
    return out


def test_a_disk_that_fills_during_a_checkpoint(tmp_path):
    """On a 1 MiB tmpfs: the checkpoint that does not fit fails on every rank with one line naming the file it
    could not write; the previous checkpoint still verifies; no partial directory remains. A finish that
    fails on rank 0 alone fails every rank too, at once (none waits for a checkpoint that will not come)."""
    from shardwise.train.checkpoint import list_checkpoints, verify_checkpoint

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({(done.stderr or done.stdout).strip()[:120]})")
    try:
        root = mount / "checkpoints"
        per_rank = run_on_ranks(2, _fill_the_disk, str(root))
        for rank, (first, full, bad_meta) in enumerate(per_rank):
            assert first is None, first
            assert full.startswith("checkpoint step 2 was not written: rank ") and "\n" not in full, full
            assert f"cannot write {root}/.tmp-step_00000002-" in full and "No space left on device" in full, full
            assert bad_meta.startswith("checkpoint step 3 was not written: rank 0: ValueError: checkpoint meta"), \
                (rank, bad_meta)
        assert [p.name for p in list_checkpoints(root)] == ["step_00000001"]
        verify_checkpoint(root / "step_00000001")
        assert sorted(p.name for p in root.iterdir()) == ["step_00000001"], "a partial directory remains"
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
