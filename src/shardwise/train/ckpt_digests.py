"""SHA-256 digests of a checkpoint's bytes: a whole file, each tensor entry of a safetensors file, a tensor.

A checkpoint's manifest (:mod:`shardwise.train.checkpoint`) records every file's size and SHA-256 (FIPS 180-4)
and, for a safetensors file, the SHA-256 of each tensor entry's bytes. The file digests let a tool verify a
checkpoint as a whole; the entry digests let a rank resuming from a sharded checkpoint verify exactly the
tensors it reads (:class:`shardwise.train.sharded.ShardedReader`), so no rank reads the shards of the others.

The safetensors layout -- an 8-byte little-endian header length, a JSON header giving each tensor's
``data_offsets`` relative to the end of the header, then the tensors' raw bytes
(https://github.com/huggingface/safetensors, "Format") -- lets one sequential read of a file feed the file's
digest and every entry's at once, so writing the entry digests reads nothing more than the file digest did.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

CHUNK = 1 << 20
"""Bytes read at a time while hashing."""


def file_sha256(path: Path) -> tuple[int, str]:
    """``(size, SHA-256 hex)`` of the file ``path``, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def safetensors_sha256(path: Path) -> tuple[int, str, dict[str, str]]:
    """``(size, SHA-256 of the file, {entry: SHA-256 of its bytes})`` of the safetensors file ``path``, in one
    sequential read."""
    whole = hashlib.sha256()
    with open(path, "rb") as f:
        prefix = f.read(8)
        header = f.read(int.from_bytes(prefix, "little"))
        whole.update(prefix)
        whole.update(header)
        spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                       for name, info in json.loads(header).items() if name != "__metadata__")
        entries = {name: hashlib.sha256() for _, _, name in spans}
        size, pos, first = len(prefix) + len(header), 0, 0  # pos: offset in the data section
        while chunk := f.read(CHUNK):
            whole.update(chunk)
            view, end = memoryview(chunk), pos + len(chunk)
            while first < len(spans) and spans[first][1] <= pos:
                first += 1  # entries that ended before this chunk
            for begin, stop, name in spans[first:]:
                if begin >= end:
                    break
                entries[name].update(view[max(begin, pos) - pos:min(stop, end) - pos])
            size, pos = size + len(chunk), end
    return size, whole.hexdigest(), {name: h.hexdigest() for name, h in entries.items()}


def update_sha256(h, values: torch.Tensor) -> None:
    """Feed the raw bytes of the contiguous CPU tensor ``values`` to the running digest ``h`` (as safetensors
    stores them: little-endian, the machine's order on every platform torch supports)."""
    if values.numel():
        h.update(values.reshape(-1).view(torch.uint8).numpy())
