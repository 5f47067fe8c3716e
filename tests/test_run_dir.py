"""Nothing lost, nothing mixed: what the launcher refuses before any worker starts, and what it leaves as it was.

One tiny run with checkpoints at steps 1 and 2 (trained once in the reusable pool) is copied for each case;
every refusal is one line (ConfigError) and leaves every file of the run byte for byte as it was.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardwise.config import ConfigError
from shardwise.run_dir import LatestLink
from shardwise.train.checkpoint import list_checkpoints
from tests.test_train import make_config, run


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir) -> Path:
    tmp = tmp_path_factory.mktemp("run-dir")
    run(tmp, cache_dir, "run", 1, **{"train.steps": 2, "ckpt.every": 1, "ckpt.keep": 3})
    return tmp / "run"


def _copy(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run whose config.toml names the copy as its run.dir."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace(str(trained), str(run_dir)))
    return run_dir


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _refused(run_dir: Path, cache_dir: Path, fragment: str, **overrides) -> str:
    before = _snapshot(run_dir) if run_dir.exists() else None
    with pytest.raises(ConfigError) as e:
        make_config(run_dir, cache_dir, 1, **{"train.steps": 2, **overrides})
    message = str(e.value)
    assert fragment in message and "\n" not in message, message
    assert (_snapshot(run_dir) if run_dir.exists() else None) == before, "a refused launch changed the run"
    return message


def test_a_directory_holding_a_run_is_refused_without_resume(trained, tmp_path, cache_dir):
    run_dir = _copy(trained, tmp_path)
    message = _refused(run_dir, cache_dir, "already holds a run (metrics.jsonl)")
    assert f"shardwise train {run_dir / 'config.toml'} --resume" in message


def test_a_resume_that_cannot_work_is_refused_and_changes_nothing(trained, tmp_path, cache_dir):
    """Another model (here Llama-shaped): the tensor and both shapes are named, before config.toml is touched."""
    run_dir = _copy(trained, tmp_path)
    _refused(run_dir, cache_dir, "holds 'blocks.0.attn.k_proj.weight' of shape [64, 64], where model.preset="
             "'tiny-llama' (llama) has [32, 64]", **{"model.preset": "tiny-llama", "ckpt.resume": "true"})
    _refused(run_dir, cache_dir, "was not trained with fp16",
             **{"train.precision": "fp16", "ckpt.resume": "true"})


def test_resume_with_nothing_to_resume_fails(trained, tmp_path, cache_dir):
    """A directory that does not exist (and is not created), one without checkpoints, one whose every
    checkpoint is corrupt (kept as they are: the only evidence left)."""
    _refused(tmp_path / "absent", cache_dir, "does not exist: nothing to resume", **{"ckpt.resume": "true"})
    assert not (tmp_path / "absent").exists()
    run_dir = _copy(trained, tmp_path)
    for path in list_checkpoints(run_dir / "checkpoints"):
        (path / "state.json").write_text("{}")
    _refused(run_dir, cache_dir, "none of the 2 checkpoint(s)", **{"ckpt.resume": "true"})
    shutil.rmtree(run_dir / "checkpoints")
    _refused(run_dir, cache_dir, "holds no checkpoint: nothing to resume", **{"ckpt.resume": "true"})


def test_a_corrupt_checkpoint_is_set_aside_not_overwritten(trained, tmp_path, cache_dir, capsys):
    """The newest checkpoint is corrupt: a resume starts from the one before, and the corrupt one is renamed
    ``step_00000002.corrupt`` with its bytes, where no later save of step 2 or pruning reaches it."""
    run_dir = _copy(trained, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000002"
    (newest / "state.json").write_text("{}")
    evidence = _snapshot(newest)
    make_config(run_dir, cache_dir, 1, **{"train.steps": 2, "ckpt.resume": "true"})
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000001"]
    assert _snapshot(run_dir / "checkpoints" / "step_00000002.corrupt") == evidence
    assert "set aside a corrupt checkpoint as step_00000002.corrupt: checkpoint" in capsys.readouterr().err


def test_runs_latest_moves_only_once_a_checkpoint_exists(tmp_path):
    """A run that fails before its first checkpoint leaves runs/latest at the previous run."""
    runs = tmp_path / "runs"
    old, new = runs / "old", runs / "new"
    (old / "checkpoints" / "step_00000001").mkdir(parents=True)
    (new / "checkpoints").mkdir(parents=True)
    (runs / "latest").symlink_to("old")
    with pytest.raises(RuntimeError), LatestLink(new, poll_s=0.01):
        raise RuntimeError("a worker failed before the first checkpoint")
    assert (runs / "latest").resolve() == old.resolve()
    with LatestLink(new, poll_s=0.01) as link:
        (new / "checkpoints" / "step_00000001").mkdir()
    assert link.pointed and (runs / "latest").resolve() == new.resolve()


def test_a_run_dir_that_is_a_file_is_named(tmp_path, cache_dir):
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file", cache_dir, f"run.dir='{tmp_path / 'file'}' is a file, not a directory")
    _refused(tmp_path / "file" / "sub", cache_dir, f"is inside {tmp_path / 'file'}, which is a file")


@pytest.mark.parametrize("where", ["absolute", "parent", "unlisted"])
def test_a_checkpoint_names_only_its_own_listed_files(trained, tmp_path, where):
    """state.json edited to place a tensor in a file outside the checkpoint (an absolute path, ``../``) or in
    one its manifest does not list -- with the manifest's checksum of state.json updated, so the checkpoint
    verifies -- is refused naming the file, before the file is opened."""
    import hashlib
    import json

    from shardwise.train.checkpoint import CheckpointError, verify_checkpoint
    from shardwise.train.state import open_checkpoint

    ckpt = _copy(trained, tmp_path) / "checkpoints" / "step_00000002"
    shard = next(ckpt.glob("shard-*.safetensors"))
    outside = {"absolute": str(tmp_path / "outside.safetensors"), "parent": "../outside.safetensors",
               "unlisted": "extra.safetensors"}[where]
    for target in (tmp_path / "outside.safetensors", ckpt.parent / "outside.safetensors", ckpt / "extra.safetensors"):
        shutil.copy(shard, target)
    state = json.loads((ckpt / "state.json").read_text())
    key = next(iter(state["shards"]))
    state["shards"][key]["pieces"][0][0] = outside
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "state.json").read_bytes()
    manifest["files"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    verify_checkpoint(ckpt)  # the crafted checkpoint is consistent with its manifest
    with pytest.raises(CheckpointError, match=f"in file {outside!r}, which is not a file of the checkpoint"):
        open_checkpoint(ckpt)


def test_generate_with_a_config_that_does_not_fit_its_checkpoint_is_one_line(trained, tmp_path, capsys):
    """config.toml edited to another width: ``shardwise generate`` names the tensor and both shapes (exit 2)
    instead of load_state_dict's many lines."""
    from shardwise.cli import main

    run_dir = _copy(trained, tmp_path)
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("d_model = 64", "d_model = 32"))
    assert main(["generate", str(run_dir), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds 'tok_emb.weight' of shape [257, 64], where model.preset='tiny' (gpt2) has " \
                               "[257, 32]" in err[0], err
