"""Sharded checkpoints: each rank writes what it holds, and any layout reads any checkpoint.

ZeRO ranks write the slices of their own shards (no rank writes a whole large tensor), pipeline stages
their own layers; the index in state.json assembles the single-process state from them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.train.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from shardwise.train.state import open_checkpoint
from tests.test_train import run

TINY = {"train.steps": 2, "ckpt.every": 2}



def _checkpoint(run_dir: Path) -> Path:
    (path,) = list_checkpoints(run_dir / "checkpoints")
    verify_checkpoint(path)
    return path


def test_zero3_ranks_write_their_own_slices(tmp_path, cache_dir):
    _, final, _ = run(tmp_path, cache_dir, "zero3", 2, **TINY, **{"parallel.zero": 3})
    path = _checkpoint(tmp_path / "zero3")
    assert sorted(p.name for p in path.glob("shard-*.safetensors")) == ["shard-00000.safetensors",
                                                                         "shard-00001.safetensors"]
    reader = open_checkpoint(path)
    table = reader.index["model/tok_emb.weight"]
    assert {piece[0] for piece in table["pieces"]} == {"shard-00000.safetensors", "shard-00001.safetensors"}
    assert all(stop - start < torch.Size(table["shape"]).numel() for _, _, start, stop in table["pieces"])
    model = reader.model_state()
    for name, value in final.items():
        assert torch.equal(model[name], value), name
    moments = reader.optimizer_state()["state"]
    assert all({"step", "exp_avg", "exp_avg_sq"} <= set(st) for st in moments.values())
    # A range across the two ranks' pieces, read without assembling the whole tensor.
    (_, _, _, boundary), *_ = sorted(table["pieces"], key=lambda p: p[2])
    full = model["tok_emb.weight"].reshape(-1)
    across = reader.slice("model/tok_emb.weight", boundary - 5, boundary + 7)
    assert torch.equal(across, full[boundary - 5:boundary + 7])


def test_pipeline_stages_write_their_own_layers(tmp_path, cache_dir):
    run(tmp_path, cache_dir, "pp", 2, **TINY, **{"model.n_layers": 4, "parallel.pp": 2,
                                                 "parallel.pp_partition": "2"})
    reader = open_checkpoint(_checkpoint(tmp_path / "pp"))
    files = {key: {p[0] for p in info["pieces"]} for key, info in reader.index.items()}
    assert files["model/blocks.0.attn.q_proj.weight"] == {"shard-00000.safetensors"}
    assert files["model/blocks.3.attn.q_proj.weight"] == {"shard-00001.safetensors"}
    assert files["model/lm_head.weight"] == {"shard-00001.safetensors"}


def test_data_parallel_checkpoint_resumes_under_zero2(tmp_path, cache_dir):
    steps = {"train.steps": 4, "ckpt.every": 2}
    uninterrupted = run(tmp_path, cache_dir, "dp", 2, **steps)
    run(tmp_path, cache_dir, "moved", 2, stop_after=2, **steps)
    resumed = run(tmp_path, cache_dir, "moved", 2, **steps, **{"parallel.zero": 2, "ckpt.resume": "true"})
    torch.testing.assert_close(torch.tensor(resumed[0]), torch.tensor(uninterrupted[0][2:]), atol=1e-6, rtol=0)
    for name, value in uninterrupted[1].items():
        torch.testing.assert_close(resumed[1][name], value, atol=1e-6, rtol=0, msg=name)


def test_missing_piece_is_reported(tmp_path, cache_dir):
    run(tmp_path, cache_dir, "zero1", 2, **TINY, **{"parallel.zero": 1})
    reader = open_checkpoint(_checkpoint(tmp_path / "zero1"))
    table = reader.index["model/tok_emb.weight"]
    table["pieces"] = [p for p in table["pieces"] if p[0] != "shard-00001.safetensors"]
    with pytest.raises(CheckpointError, match="tok_emb.weight.*lacks elements"):
        reader.model_state()["tok_emb.weight"]
