"""One agreed resume, each rank reading its share (shardwise.train.resume).

Three layouts on 4 gloo ranks -- dp 4, ZeRO-3 dp 4, tp 2 x pp 2 -- train 2 steps with a checkpoint after each
(one harness call); copies of their run directories resume from step 2, and the trainer's own reader counts
the bytes each rank reads (``TrainResult.resume_bytes_read``, by file):

* every byte at most once, and nothing beyond the rank's share: dp 4 ranks each hold the whole state, so each
  reads the one file holding it (rank 0's) and nothing else; a ZeRO-3 rank reads its own file, and of rank 0's
  only its header and the rank's RNG state; a tp x pp rank reads its own file, of its tensor-parallel peer's only
  the tensors the two hold whole (replicated: norms, biases, positions), of the other stage's files nothing
  but headers and its RNG state. Before, every rank hashed every file and then loaded its share again.
* one rank cannot verify the newest checkpoint: rank 2's reads of step 2 fail (a transient read error only it
  sees), or a byte of rank 2's ZeRO-3 file of step 2 is flipped (only rank 2 reads that file). Every rank
  resumes from step 1 together, and the run ends bit-identical to the uninterrupted one. When rank 2 can read
  neither checkpoint, every rank fails with the same one line.
* the launcher's check before a resume reads no shard (it hashes ``state.json`` only).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardwise.train.checkpoint import list_checkpoints, read_state
from tests.harness import run_on_ranks
from tests.test_train import make_config

BASE = {"train.steps": 2, "ckpt.every": 1, "ckpt.keep": 3, "train.global_batch": 4, "data.seq_len": 16}
LAYOUTS = {"dp4": {}, "zero3-dp4": {"parallel.zero": 3},
           "tp2-pp2": {"parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 2}}


def _train_jobs(jobs):
    """Rank body: trainer runs in a row; per run (the step it resumed from, losses, rank 0's final weights, the
    bytes this rank read of the checkpoint it resumed from, by file), or the line a CheckpointError said. A job
    naming ``(rank, steps)`` runs with that rank unable to open any file of those checkpoints (as an I/O error
    only it sees)."""
    import torch.distributed as dist

    from shardwise.train import sharded
    from shardwise.train.checkpoint import CheckpointError
    from shardwise.train.loop import train

    real, out = sharded.safe_open, []
    for cfg, run_dir, (failing_rank, steps) in jobs:
        def failing_open(path, *args, steps=steps, **kwargs):
            if any(f"step_{s:08d}" in str(path) for s in steps):
                raise OSError(5, "Input/output error (injected)")
            return real(path, *args, **kwargs)

        if dist.get_rank() == failing_rank:
            sharded.safe_open = failing_open
        try:
            r = train(cfg, Path(run_dir), collect_state=True)
            out.append((r.final_step - len(r.losses), r.losses, r.state_dict if dist.get_rank() == 0 else None,
                        r.resume_bytes_read))
        except CheckpointError as e:
            out.append(str(e))
        finally:
            sharded.safe_open = real
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # in the data section: the header is intact, the size unchanged
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("agreed")
    jobs = [(make_config(tmp / name, cache_dir, 4, **BASE, **o), str(tmp / name), (None, ()))
            for name, o in LAYOUTS.items()]
    full = dict(zip(LAYOUTS, run_on_ranks(4, _train_jobs, jobs)[0], strict=True))
    newest = _copy(tmp / "zero3-dp4", tmp / "corrupt") / "checkpoints" / "step_00000002"
    _flip_last_byte(newest / "shard-00002.safetensors")
    faults = {"unreadable": (2, (2,)), "all-unreadable": (2, (1, 2))}  # rank 2 cannot read these steps
    names = [*LAYOUTS, *faults, "corrupt"]
    jobs = []
    for name in names:
        layout = name if name in LAYOUTS else "zero3-dp4"
        run_dir = tmp / name if name == "corrupt" else _copy(tmp / layout, tmp / f"{name}-resumed")
        jobs.append((make_config(run_dir, cache_dir, 4, **BASE, **LAYOUTS[layout], **{"ckpt.resume": True}),
                     str(run_dir), faults.get(name, (None, ()))))
    resumed = run_on_ranks(4, _train_jobs, jobs)
    return full, {name: [r[i] for r in resumed] for i, name in enumerate(names)}, tmp


def _files(checkpoint: Path) -> dict[str, dict]:
    """Per shard file: its size, its header's size and its entries ``{name: (key, bytes, whole tensor?)}``."""
    meta = read_state(checkpoint)
    out = {}
    for p in sorted(checkpoint.glob("shard-*.safetensors")):
        with open(p, "rb") as f:
            header = 8 + int.from_bytes(f.read(8), "little")
        out[p.name] = {"size": p.stat().st_size, "header": header, "entries": {}}
    for key, info in meta["shards"].items():
        numel, itemsize = 1, torch.empty(0, dtype=getattr(torch, info["dtype"])).element_size()
        for n in info["shape"]:
            numel *= n
        for file, entry, a, b in info["pieces"]:
            out[file]["entries"][entry] = (key, (b - a) * itemsize, a == 0 and b == numel)
    return out


def _allowed(layout: str, rank: int, files: dict[str, dict]) -> dict[str, int]:
    """The most bytes rank ``rank`` may read of each shard file on a resume in its own layout: what it holds."""
    own = f"shard-{rank:05d}.safetensors"
    rng = f"rng/rank{rank}"
    allowed = {}
    for name, f in files.items():
        mine = sum(n for key, n, _ in f["entries"].values() if key == rng)
        if layout == "dp4" and name == "shard-00000.safetensors" or name == own:
            allowed[name] = f["size"]  # dp: rank 0's file holds the whole state, every replica reads it
        elif layout == "tp2-pp2" and int(name[6:11]) // 2 == rank // 2:  # the tensor-parallel peer's file
            allowed[name] = f["header"] + mine + sum(n for key, n, whole in f["entries"].values()
                                                     if whole and key.startswith(("model/", "optim/")))
        else:
            allowed[name] = f["header"] + mine
    return allowed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_reads_its_share_once(runs, layout):
    full, resumed, tmp = runs
    files = _files(tmp / layout / "checkpoints" / "step_00000002")
    total = sum(f["size"] for f in files.values())
    for rank, (start, losses, _, read) in enumerate(resumed[layout]):
        assert start == 2 and losses == [], f"rank {rank} resumed from step {start}"
        assert {"manifest.json", "state.json"} <= set(read)
        allowed = _allowed(layout, rank, files)
        shards = {k: v for k, v in read.items() if k.startswith("shard-")}
        for name, n in shards.items():
            assert n <= allowed[name], f"rank {rank} read {n} bytes of {name}; its share is {allowed[name]}"
        if layout != "dp4":
            assert sum(shards.values()) < total / 2, f"rank {rank} read {sum(shards.values())} of {total} bytes"


@pytest.mark.parametrize("case", ["unreadable", "corrupt"])
def test_one_rank_that_cannot_verify_sends_every_rank_back_together(runs, case):
    full, resumed, tmp = runs
    starts = [start for start, *_ in resumed[case]]
    assert starts == [1, 1, 1, 1], f"ranks resumed from steps {starts}"
    uninterrupted, again = full["zero3-dp4"], resumed[case][0]
    assert again[1] == uninterrupted[1][1:]
    for key, value in uninterrupted[2].items():
        assert torch.equal(value, again[2][key]), key
    checkpoints = tmp / ("corrupt" if case == "corrupt" else f"{case}-resumed") / "checkpoints"
    kept = checkpoints / "step_00000002.corrupt"
    assert (kept / "shard-00002.safetensors").is_file(), "the checkpoint not every rank could verify is kept aside"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_00000001", "step_00000002"]


def test_when_no_checkpoint_verifies_on_every_rank_every_rank_fails_with_one_line(runs):
    _, resumed, tmp = runs
    lines = resumed["all-unreadable"]
    assert all(isinstance(line, str) for line in lines), lines
    assert len(set(lines)) == 1 and "\n" not in lines[0], lines
    assert "no checkpoint in" in lines[0] and "verifies on every rank" in lines[0] and "rank 2" in lines[0]
    checkpoints = tmp / "all-unreadable-resumed" / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_00000001", "step_00000002"], "left as they are"


def test_the_launcher_check_reads_no_shard(runs, tmp_path, cache_dir, monkeypatch):
    """``--resume`` checks the checkpoint's structure before any worker starts; of its files it hashes only
    ``state.json`` -- a flipped byte in a shard is left to the ranks that read it."""
    from shardwise.train import checkpoint

    _, _, tmp = runs
    run_dir = _copy(tmp / "zero3-dp4", tmp_path / "run")
    _flip_last_byte(run_dir / "checkpoints" / "step_00000002" / "shard-00001.safetensors")
    hashed = []
    real = checkpoint.file_sha256
    monkeypatch.setattr(checkpoint, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    make_config(run_dir, cache_dir, 4, **BASE, **LAYOUTS["zero3-dp4"], **{"ckpt.resume": True})
    assert hashed == ["state.json"]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000001", "step_00000002"]
