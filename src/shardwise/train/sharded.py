"""Sharded, layout-free checkpoints: every rank writes the pieces of the training state it holds.

The state is always that of a single-process run: the model's ``state_dict()`` (``model/<name>``), the
optimizer state per parameter index of the single-process optimizer (``optim/<index>/<name>``,
:func:`shardwise.train.optim.optimizer_param_names` gives the order) and every rank's RNG
(``rng/rank<r>``). A :class:`Piece` is elements ``[start, start + n)`` of one such tensor, flattened.
A data-parallel rank 0 writes whole tensors; a ZeRO rank writes the slices of its shard (no rank ever
holds the whole state, Rajbhandari et al. 2020 §5); a pipeline stage writes its own layers. Each writer
puts its pieces in ``shard-<rank>.safetensors`` of one checkpoint directory, written and renamed into
place atomically (:mod:`shardwise.train.checkpoint`), and ``state.json`` indexes which file holds which
range of which tensor. Loading assembles whatever range a rank of the *new* layout needs from those
files (read lazily with ``safetensors.safe_open``), so any checkpoint resumes on any layout -- the
resharding-on-load of ``torch.distributed.checkpoint``, here for our own flat shards. Checkpoints
need one file system visible to every writer (as DCP's file-system writer does).

A reader that ``verify``-s checks every tensor entry it reads against the SHA-256 the manifest records for
it (:mod:`shardwise.train.ckpt_digests`) as it reads it, once, and counts the bytes it reads per file
(``bytes_read``): a resuming rank verifies exactly its share of the checkpoint, not every rank's files
(:mod:`shardwise.train.resume`). Where a range is held twice (the ZeRO ranks' copies of a step count), it
reads the copy in a file it has opened already, else in its own rank's file (``own_file``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from shardwise.train.checkpoint import (
    CheckpointError,
    abandon_checkpoint,
    begin_checkpoint,
    finish_checkpoint,
    read_manifest,
    verify_file,
    write_tensor_file,
)
from shardwise.train.ckpt_digests import CHUNK, update_sha256
from shardwise.train.optim_state import optimizer_state_from_tensors

SHARD_STEM = "shard-{rank:05d}"
"""The file (stem) each rank writes its pieces into."""


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + values.numel())`` of the flattened tensor ``key`` of shape ``shape``."""

    key: str
    values: torch.Tensor
    start: int
    shape: tuple[int, ...]


def whole(key: str, tensor: torch.Tensor) -> Piece:
    """All of ``tensor`` as one piece."""
    return Piece(key, tensor.detach().reshape(-1), 0, tuple(tensor.shape))


def save_sharded(root: Path, step: int, pieces: list[Piece], meta: dict[str, Any] | None, keep: int,
                 after_write: Callable[[], None] | None = None) -> None:
    """Write checkpoint ``step``: every rank its ``pieces``, global rank 0 also ``meta`` (None elsewhere)
    with the index added. A collective over the default group; a failed writer fails every rank.
    ``after_write`` runs once this rank's file is written (failover tests kill the writer there)."""
    rank = dist.get_rank()
    holder = [begin_checkpoint(root, step) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    tmp = Path(holder[0])
    written = write_pieces(tmp, rank, pieces)
    if after_write is not None:
        after_write()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, written)
    failure: list = [None]
    if rank == 0:
        try:
            finish_pieces(root, step, tmp, everyone, meta, keep)
        except CheckpointError as e:
            failure = [str(e)]
        except Exception as e:  # noqa: BLE001 - every rank fails with it, at once
            failure = [f"checkpoint step {step} was not written: rank 0: {type(e).__name__}: {e}"]
    dist.broadcast_object_list(failure, src=0)  # complete (or not) on every rank from here: none waits for a
    if failure[0] is not None:  # finish that failed
        raise CheckpointError(failure[0])


def write_pieces(tmp: Path, rank: int, pieces: list[Piece]) -> tuple[dict, list, str | None]:
    """Write this rank's ``pieces`` as ``shard-<rank>.safetensors`` into the temporary checkpoint ``tmp``:
    ``(manifest entry, index rows, error text or None)`` -- what rank 0 needs to finish the checkpoint."""
    files, index, error = {}, [], None
    try:
        if pieces:
            entries = {f"{p.key}@{p.start}": p.values.reshape(-1) for p in pieces}
            files = write_tensor_file(tmp, SHARD_STEM.format(rank=rank), entries)
            (name,) = files
            index = [(p.key, name, f"{p.key}@{p.start}", p.start, p.values.numel(), list(p.shape),
                      str(p.values.dtype).removeprefix("torch.")) for p in pieces]
    except Exception as e:  # noqa: BLE001 - reported to rank 0 (and every rank), then raised
        error = f"rank {rank}: {type(e).__name__}: {e}"
    return files, index, error


def finish_pieces(root: Path, step: int, tmp: Path, everyone: list, meta: dict[str, Any], keep: int) -> None:
    """Rank 0: join every rank's :func:`write_pieces` result into the index, write ``state.json`` and the
    manifest, rename into place (or remove ``tmp`` and raise when a writer failed)."""
    errors = [e for _, _, e in everyone if e]
    if errors:
        abandon_checkpoint(tmp)
        raise CheckpointError(f"checkpoint step {step} was not written: {errors[0]}")
    all_files: dict[str, Any] = {}
    shards: dict[str, dict[str, Any]] = {}
    for f, idx, _ in everyone:
        all_files.update(f)
        for key, file, entry, start, numel, shape, dtype in idx:
            info = shards.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
            info["pieces"].append([file, entry, start, start + numel])
    try:
        finish_checkpoint(root, step, tmp, all_files, {**meta, "shards": shards}, keep)
    except BaseException:
        abandon_checkpoint(tmp)
        raise


class ShardedReader:
    """Assemble tensors of a sharded checkpoint from its files, one tensor at a time; with ``verify``, each
    tensor entry read is checked against its digest in the manifest (a file without entry digests, written
    before they existed, is hashed whole when first opened)."""

    def __init__(self, path: Path, meta: Mapping[str, Any], verify: bool = False, own_file: str | None = None,
                 manifest: dict[str, Any] | None = None):
        self.path, self.meta, self.verify, self.own_file = Path(path), meta, verify, own_file
        self.index: dict[str, dict[str, Any]] = meta["shards"]
        self._open: dict[str, Any] = {}
        self._verified: set[tuple[str, str]] = set()
        self.bytes_read: dict[str, int] = {}
        """Bytes this reader read, by file name: safetensors headers, tensor entries, whole-file digests."""
        self.manifest = read_manifest(self.path) if manifest is None else manifest
        listed = self.manifest["files"]  # plain names inside the directory, each with a size and SHA-256
        for key, info in self.index.items():  # a file the manifest does not cover is never opened
            for piece in info["pieces"]:
                if piece[0] not in listed:
                    raise CheckpointError(f"checkpoint {self.path}: state.json places {key!r} in file {piece[0]!r}, "
                                          "which is not a file of the checkpoint listed in its manifest")

    def _count(self, name: str, nbytes: int) -> None:
        self.bytes_read[name] = self.bytes_read.get(name, 0) + nbytes

    def _file(self, name: str):
        if name not in self._open:
            digests = "entries" in self.manifest["files"][name]
            if self.verify and not digests and (name, "") not in self._verified:
                self._count(name, verify_file(self.path, name, self.manifest))  # an older checkpoint: the file
                self._verified.add((name, ""))
            try:
                with open(self.path / name, "rb") as f:  # what safe_open reads of it: the header
                    self._count(name, 8 + int.from_bytes(f.read(8), "little"))
                self._open[name] = safe_open(str(self.path / name), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"checkpoint {self.path}: file {name} cannot be read by safetensors: {e}") from e
        return self._open[name]

    def _read(self, file: str, entry: str, numel: int, lo: int, hi: int, itemsize: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the entry ``entry`` (``numel`` elements of ``itemsize`` bytes) of ``file``.
        Verifying, an entry not read before is read whole, in chunks, and its digest checked; the range is taken
        from those chunks."""
        part = self._file(file).get_slice(entry)
        expected = self.manifest["files"][file].get("entries", {}).get(entry) if self.verify else None
        if expected is None or (file, entry) in self._verified:
            values = part[lo:hi]
            self._count(file, values.numel() * values.element_size())
            return values
        digest, kept = hashlib.sha256(), []
        step = max(1, CHUNK // itemsize)
        for c0 in range(0, max(numel, 1), step):
            chunk = part[c0:min(numel, c0 + step)]
            update_sha256(digest, chunk)
            self._count(file, chunk.numel() * chunk.element_size())
            if c0 < hi and c0 + chunk.numel() > lo:
                kept.append(chunk[max(lo, c0) - c0:min(hi, c0 + chunk.numel()) - c0])
        if digest.hexdigest() != expected:
            raise CheckpointError(f"checkpoint {self.path}: tensor {entry!r} of file {file} is corrupt (sha256 "
                                  f"{digest.hexdigest()[:12]}..., expected {expected[:12]}...)")
        self._verified.add((file, entry))
        return torch.cat(kept) if len(kept) != 1 else kept[0]

    def _preference(self, file: str) -> int:
        """Where a range is held twice: a file read already first, then this rank's own."""
        return 0 if file in self._open else 1 if file == self.own_file else 2

    def close(self) -> None:
        """Close the files opened so far: safetensors maps them into memory, and the pages read stay in the
        process's resident set until the file is closed (a streaming reader closes them after each tensor)."""
        self._open.clear()

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.index if k.startswith(prefix)]

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``; its pieces must cover it (duplicates of a range are skipped)."""
        if key not in self.index:
            raise CheckpointError(f"checkpoint {self.path} holds no tensor {key!r}")
        shape = self.index[key]["shape"]
        return self.slice(key, 0, math.prod(shape)).view(shape)

    def slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, reading only the overlapping
        ranges of its pieces (``safe_open(...).get_slice``): what a ZeRO rank needs of a moment."""
        if key not in self.index:
            raise CheckpointError(f"checkpoint {self.path} holds no tensor {key!r}")
        info = self.index[key]
        out = torch.empty(stop - start, dtype=getattr(torch, info["dtype"]))
        itemsize = out.element_size()
        pos = start
        while pos < stop:
            covering = [p for p in info["pieces"] if p[2] <= pos < p[3]]
            if not covering:
                raise CheckpointError(f"checkpoint {self.path}: tensor {key!r} lacks elements {pos}..{stop}")
            file, entry, a, b = min(covering, key=lambda p: (self._preference(p[0]), -p[3]))
            hi = min(b, stop)
            out[pos - start:hi - start] = self._read(file, entry, b - a, pos - a, hi - a, itemsize)
            pos = hi
        return out

    def model_state(self) -> LazyState:
        return LazyState(self, "model/")

    def optimizer_state(self) -> dict[str, Any]:
        """``{"state": {index: LazyState}, "param_groups": [...]}`` in the single-process optimizer's form."""
        indices = sorted({int(k.split("/")[1]) for k in self.keys("optim/")})
        groups = optimizer_state_from_tensors({}, self.meta["optimizer"])["param_groups"]
        return {"state": {i: LazyState(self, f"optim/{i}/") for i in indices}, "param_groups": groups}

    def rng(self, rank: int) -> torch.Tensor:
        key = f"rng/rank{rank}" if f"rng/rank{rank}" in self.index else "rng/rank0"
        return self.full(key)


class LazyState(Mapping):
    """The tensors under one prefix of a checkpoint, read when first looked up (dict-like)."""

    def __init__(self, reader: ShardedReader, prefix: str):
        self.reader, self.prefix = reader, prefix
        self._names = [k[len(prefix):] for k in reader.keys(prefix)]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self.reader.full(self.prefix + name)

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def ndim(self, name: str) -> int:
        return len(self.reader.index[self.prefix + name]["shape"])

    def read_slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``name`` only."""
        return self.reader.slice(self.prefix + name, start, stop)

    def read_rows(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` along ``dim`` of tensor ``name`` only (a tensor-parallel rank's part): one run of
        elements per index of the dims before ``dim``."""
        shape = self.reader.index[self.prefix + name]["shape"]
        inner, outer = math.prod(shape[dim + 1:]), math.prod(shape[:dim])
        runs = [self.read_slice(name, (i * shape[dim] + start) * inner, (i * shape[dim] + stop) * inner)
                for i in range(outer)]
        return torch.cat(runs).view(*shape[:dim], stop - start, *shape[dim + 1:])

    def materialize(self) -> dict[str, torch.Tensor]:
        return {name: self[name] for name in self._names}


def materialized_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every lazy per-parameter state read (for ``torch.optim`` loading)."""
    return {"state": {i: dict(v) for i, v in state["state"].items()}, "param_groups": state["param_groups"]}
