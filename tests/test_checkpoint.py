"""Checkpoint save/verify/load: round trips, pruning, corruption and crash safety."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch import nn

from shardwise.train import checkpoint as ckpt
from shardwise.train.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from shardwise.train.optim_state import optimizer_state_from_tensors, optimizer_state_to_tensors


class TinyLM(nn.Module):
    """Embedding -> MLP -> head whose weight is tied to the embedding."""

    def __init__(self, vocab: int = 17, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mlp(self.emb(idx))))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 17, (4, 6), generator=g), torch.randint(0, 17, (4, 6), generator=g)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = _batch(seed)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _save_trained(root, step: int, keep: int = 3) -> tuple[TinyLM, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(3):
        _train_step(model, opt, s)
    otensors, ometa = optimizer_state_to_tensors(opt.state_dict())
    path = save_checkpoint(root, step, {"model": model.state_dict(), "optim": otensors}, {"optim": ometa}, keep)
    return model, opt, path


def _simple_save(root, step: int, keep: int = 10):
    return save_checkpoint(root, step, {"model": {"w": torch.full((64,), float(step))}}, {"step": step}, keep)


def test_round_trip_model_and_adamw_bit_identical(tmp_path):
    model, opt, path = _save_trained(tmp_path, 3)
    assert path == tmp_path / "step_00000003"
    tensors, meta = load_checkpoint(path)

    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    fresh = TinyLM()
    fresh.load_state_dict(tensors["model"])
    assert fresh.head.weight is fresh.emb.weight
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    restored = optimizer_state_from_tensors(tensors["optim"], meta["optim"])
    assert restored["param_groups"][0]["betas"] == opt.state_dict()["param_groups"][0]["betas"]
    assert isinstance(restored["param_groups"][0]["betas"], tuple)
    assert isinstance(restored["state"][0]["step"], torch.Tensor)
    fopt.load_state_dict(restored)

    _train_step(model, opt, 99)
    _train_step(fresh, fopt, 99)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_optimizer_state_round_trip_exact():
    p = nn.Parameter(torch.randn(5))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(5)
    opt.step()
    sd = opt.state_dict()
    tensors, meta = optimizer_state_to_tensors(sd)
    json.dumps(meta)  # metadata is plain JSON
    assert set(tensors) == {"state.0.momentum_buffer"}
    back = optimizer_state_from_tensors(tensors, json.loads(json.dumps(meta)))
    assert back["param_groups"] == sd["param_groups"]
    assert torch.equal(back["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"])


def test_tied_and_non_contiguous_tensors_save(tmp_path):
    w = torch.randn(4, 6)
    flat = {"a": w, "b": w, "t": w.t(), "half": w[:2]}
    path = save_checkpoint(tmp_path, 0, {"model": flat}, {}, keep=1)
    tensors, _ = load_checkpoint(path)
    for k, v in flat.items():
        assert torch.equal(tensors["model"][k], v), k


def test_keep_k_pruning(tmp_path):
    for step in (10, 20, 30, 40, 50):
        _simple_save(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000040", "step_00000050"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_resave_same_step_replaces(tmp_path):
    _simple_save(tmp_path, 5)
    save_checkpoint(tmp_path, 5, {"model": {"w": torch.zeros(3)}}, {"again": True}, keep=2)
    tensors, meta = load_checkpoint(tmp_path / "step_00000005")
    assert meta == {"again": True} and torch.equal(tensors["model"]["w"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005"]


def test_bad_input_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, 1, {"model": {"w": torch.zeros(2)}}, {"x": object()}, keep=1)
    with pytest.raises(ValueError, match="stem"):
        save_checkpoint(tmp_path, 1, {"../evil": {"w": torch.zeros(2)}}, {}, keep=1)
    with pytest.raises(TypeError, match="not a tensor"):
        save_checkpoint(tmp_path, 1, {"model": {"w": [1, 2]}}, {}, keep=1)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, {}, {}, keep=0)
    assert list(tmp_path.iterdir()) == []


def _truncate(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])


def _flip_byte(path):
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))


def _remove(path):
    (path / "model.safetensors").unlink()


def _garbage_manifest(path):
    (path / "manifest.json").write_bytes(b"\x00{not json")


@pytest.mark.parametrize(
    "damage, file, words",
    [
        (_truncate, "model.safetensors", "truncated"),
        (_flip_byte, "model.safetensors", "corrupt"),
        (_remove, "model.safetensors", "missing"),
        (_garbage_manifest, "manifest.json", "unreadable"),
    ],
)
def test_corruption_detected(tmp_path, damage, file, words):
    path = _simple_save(tmp_path, 7)
    verify_checkpoint(path)
    damage(path)
    for fn in (verify_checkpoint, load_checkpoint):
        with pytest.raises(CheckpointError) as info:
            fn(path)
        msg = str(info.value)
        assert file in msg and words in msg and "step_00000007" in msg


def test_latest_valid_skips_corrupt_newest(tmp_path):
    _simple_save(tmp_path, 1)
    _simple_save(tmp_path, 2)
    _flip_byte(_simple_save(tmp_path, 3))
    warnings: list[str] = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append) == tmp_path / "step_00000002"
    assert len(warnings) == 1 and "step_00000003" in warnings[0] and "model.safetensors" in warnings[0]
    assert "\n" not in warnings[0]
    assert latest_valid_checkpoint(tmp_path / "nothing-here", warn=warnings.append) is None


def test_crash_mid_write_leaves_previous(tmp_path, monkeypatch):
    _simple_save(tmp_path, 1)
    real_save = ckpt.save_file
    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", failing_save)
    with pytest.raises(CheckpointError, match=r"cannot write .*/optim.safetensors: disk full \(simulated\)"):
        save_checkpoint(tmp_path, 2, {"model": {"w": torch.ones(4)}, "optim": {"m": torch.ones(4)}}, {}, keep=5)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]

    # A hard kill (no cleanup) leaves a temporary directory and possibly a manifest-less step dir.
    leftover = tmp_path / ".tmp-step_00000002-999999-abcd"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    half = tmp_path / "step_00000003"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    warnings: list[str] = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append) == tmp_path / "step_00000001"
    assert "manifest.json is missing" in warnings[0]
    assert leftover not in list_checkpoints(tmp_path)


def test_stale_tmp_of_this_process_removed(tmp_path):
    stale = tmp_path / f".tmp-step_00000004-{os.getpid()}-deadbeef"
    stale.mkdir(parents=True)
    other = tmp_path / ".tmp-step_00000004-1-deadbeef"  # pid 1 is alive: a live writer
    other.mkdir()
    _simple_save(tmp_path, 5)
    assert not stale.exists() and other.exists()


def test_no_pickle_anywhere(tmp_path, monkeypatch):
    path = _save_trained(tmp_path, 3)[2]
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "optim.safetensors",
        "state.json",
    ]
    for f in path.iterdir():
        data = f.read_bytes()
        assert not data.startswith(b"\x80"), f  # pickle protocol 2+ opcode
        assert not data.startswith(b"PK"), f  # torch.save zip archive

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    tensors, meta = load_checkpoint(path)
    assert set(tensors) == {"model", "optim"} and "optim" in meta


def test_manifest_step_mismatch_and_path_traversal(tmp_path):
    path = _simple_save(tmp_path, 8)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../outside"] = manifest["files"].pop("model.safetensors")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="invalid file name"):
        verify_checkpoint(path)
    moved = tmp_path / "step_00000009"
    path = _simple_save(tmp_path, 8)
    path.rename(moved)
    with pytest.raises(CheckpointError, match="says step 8"):
        verify_checkpoint(moved)
