"""Hub-style sharded safetensors, written one tensor at a time.

The Hub's convention for large models (``transformers``' ``save_pretrained(max_shard_size=...)``): the weights in
files ``model-00001-of-0000N.safetensors`` of at most ``max_shard_size`` bytes each, and
``model.safetensors.index.json`` mapping every tensor name to its file (``{"metadata": {"total_size": bytes},
"weight_map": {name: file}}``); a model that fits one shard is a single ``model.safetensors``.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once (and copies them into one
buffer), so :func:`write_streamed` writes the format itself, as its specification lays it out
(https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length, the JSON header
(each tensor's dtype, shape and ``[begin, end)`` byte offsets into the data, padded with spaces to a multiple
of 8 bytes), then the tensors' bytes back to back. The header needs only shapes and dtypes, known before any
tensor is read, so each tensor is produced, written and dropped in turn: the writer holds one tensor.
The files are read back by ``safetensors`` itself in the tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from shardwise.hf.config_map import HFError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""``--dtype`` of an export."""
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
"""``transformers``' sizes: "5GB" is 5 * 10^9 bytes, "5GiB" 5 * 2^30."""


def parse_size(text: str | int) -> int:
    """Bytes of ``"5GB"``, ``"500MiB"``, ``"1024"``; HFError (one line) for anything else."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise HFError(f"--max-shard-size={text!r} is not a size; use e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise HFError(f"--dtype={name!r} is not a dtype we export; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """The tensors (in order) of each shard: filled in order up to ``max_bytes``; HFError when one tensor alone
    is larger (a shard holds whole tensors)."""
    name, largest = max(sizes.items(), key=lambda kv: kv[1])
    if largest > max_bytes:
        raise HFError(f"--max-shard-size={max_bytes} bytes is below the largest tensor, {name} ({largest} bytes); "
                      f"use at least {largest} bytes (e.g. {math.ceil(largest / 1e6)}MB)")
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if used + size > max_bytes and shards[-1]:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_streamed(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                   produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file of ``entries`` (name, shape, dtype), asking ``produce(name)`` for each tensor only
    when its bytes are due; fsynced. Returns the file's size."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        size = nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset,
                                                                                                   offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype in entries:
            t = produce(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(t.shape)} {t.dtype}, announced {tuple(shape)} {dtype}")
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def write_index(path: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: the total bytes of the tensors and each tensor's file."""
    path.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                               indent=2) + "\n")
