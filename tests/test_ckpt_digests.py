"""Tensor-entry digests: written in the same read as the file's, checked by a verifying reader entry by entry.

One process, no training: a sharded checkpoint of two tensors written with the writer's own functions.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from shardwise.train.checkpoint import CheckpointError, begin_checkpoint, read_state
from shardwise.train.ckpt_digests import file_sha256, safetensors_sha256
from shardwise.train.sharded import Piece, ShardedReader, finish_pieces, write_pieces

A = torch.arange(6000, dtype=torch.float32)
B = torch.arange(10, dtype=torch.bfloat16)


def _checkpoint(root):
    tmp = begin_checkpoint(root, 1)
    written = write_pieces(tmp, 0, [Piece("model/a", A, 0, (6000,)), Piece("model/b", B, 0, (10,))])
    finish_pieces(root, 1, tmp, [written], {"step": 1}, keep=2)
    return root / "step_00000001"


def _header(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_entry_digests_are_the_tensors_bytes(tmp_path):
    path = _checkpoint(tmp_path) / "shard-00000.safetensors"
    size, digest, entries = safetensors_sha256(path)
    assert (size, digest) == file_sha256(path)
    assert entries == {"model/a@0": hashlib.sha256(A.numpy().tobytes()).hexdigest(),
                       "model/b@0": hashlib.sha256(B.view(torch.uint8).numpy().tobytes()).hexdigest()}
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["files"][path.name] == {"size": size, "sha256": digest, "entries": entries}


def test_a_verifying_reader_reads_each_entry_once_and_names_a_corrupt_one(tmp_path):
    ckpt = _checkpoint(tmp_path)
    shard = ckpt / "shard-00000.safetensors"
    reader = ShardedReader(ckpt, read_state(ckpt), verify=True)
    assert torch.equal(reader.slice("model/a", 100, 200), A[100:200])  # verified whole, the slice kept
    assert torch.equal(reader.full("model/a"), A)  # verified already: only the range is read
    assert reader.bytes_read == {shard.name: _header(shard) + A.numel() * 4 + A.numel() * 4}
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte belongs to b
    shard.write_bytes(bytes(data))
    reader = ShardedReader(ckpt, read_state(ckpt), verify=True)
    assert torch.equal(reader.full("model/a"), A)
    with pytest.raises(CheckpointError, match=r"tensor 'model/b@0' of file shard-00000.safetensors is corrupt"):
        reader.full("model/b")
    assert torch.equal(ShardedReader(ckpt, read_state(ckpt)).full("model/b")[:-1], B[:-1])  # unverified: read


def test_a_checkpoint_without_entry_digests_is_verified_file_by_file(tmp_path):
    """Checkpoints written before entry digests existed: the reader hashes a file whole when it first opens it."""
    ckpt = _checkpoint(tmp_path)
    shard = ckpt / "shard-00000.safetensors"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"][shard.name]["entries"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    reader = ShardedReader(ckpt, read_state(ckpt), verify=True)
    assert torch.equal(reader.full("model/b"), B)
    assert reader.bytes_read == {shard.name: shard.stat().st_size + _header(shard) + B.numel() * 2}
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="file shard-00000.safetensors is corrupt"):
        ShardedReader(ckpt, read_state(ckpt), verify=True).full("model/a")
