"""One agreed resume: every rank starts from the same checkpoint, each reading and verifying only its share.

A rank that picked "the newest checkpoint that verifies" on its own could resume from another step than its
peers -- after a read error only it saw, or while rank 0 renamed a corrupt checkpoint aside -- and the group
would train an inconsistent model without a word. And a rank that verified every file of a sharded
checkpoint read all the other ranks' shards: (ranks + nodes) x the checkpoint. So here, for each candidate,
newest first (rank 0's list, broadcast):

1. every rank reads the manifest and ``state.json`` (small; ``state.json`` checked against its digest) and the
   ranks agree, in one all-reduce, that each could and that all see the same step and manifest digest -- before
   any rank loads a tensor;
2. every rank loads its share through a reader that verifies each tensor entry against the digest the manifest
   records as it reads it (:class:`~shardwise.train.sharded.ShardedReader`): it reads, and hashes, only what it
   loads; a second all-reduce says whether every rank loaded and verified its share.

A candidate any rank could not verify is given up by all ranks together, and the next older one is loaded on
every rank (a load replaces all of the state, so what the failed one left is overwritten); when none verifies
everywhere, every rank fails with the same one line. A failure that is not the checkpoint's (a bug, a full
memory) fails every rank at once, with the failing rank's message. Only once the ranks have moved past a
rejected checkpoint does rank 0 rename it aside (:func:`~shardwise.train.checkpoint.set_aside`), so no rank
is still reading it. Loading issues no collective, so a rank that fails mid-load leaves none waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.dist.devices import exchange_device
from shardwise.train.checkpoint import (
    MANIFEST,
    STATE,
    CheckpointError,
    list_checkpoints,
    manifest_digest,
    set_aside,
    verified_state,
)
from shardwise.train.state import open_checkpoint

OK, INVALID, FAILED = 0, 1, 2
"""A rank's outcome for a candidate: usable; not verifiable (the ranks fall back); failed otherwise (all stop)."""


@dataclass
class Resumed:
    path: Path
    step: int
    """What ``load`` returned: the step training goes on from."""
    reader: Any
    bytes_read: dict[str, int] = field(default_factory=dict)
    """Bytes this rank read of the checkpoint it resumed from, by file (``manifest.json``, ``state.json`` and the
    parts of shard files it loaded), counted by the reader."""
    rejected_bytes: int = 0
    """Bytes this rank read of newer checkpoints the ranks gave up."""
    max_rank_bytes: int = 0
    """The most bytes any rank read (``bytes_read`` summed), over every rank."""


def agreed_resume(root: Path, load: Callable[[Any], int], required: bool, warn: Callable[[str], Any],
                  keep_aside: bool = True) -> Resumed | None:
    """Load the newest checkpoint under ``root`` that every rank can verify its share of, on every rank
    (``load(reader)`` puts it into the run and returns the step; a collective over the default group).

    Returns None when there is nothing to resume and it is not ``required`` (a restarted group with no
    checkpoint starts from step 0); raises :class:`CheckpointError` on every rank, with the same line, when
    ``required`` or a load was attempted and no checkpoint verifies everywhere. ``warn`` (rank 0's) gets one line
    per checkpoint given up; with ``keep_aside`` rank 0 renames those aside once the ranks have agreed."""
    rank = dist.get_rank()
    names = [[p.name for p in reversed(list_checkpoints(root))] if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    rejected: list[tuple[Path, str]] = []
    loaded_any, spent = False, 0
    for name in names[0]:
        path = Path(root) / name
        small: dict[str, int] = {}
        try:  # 1. the small files, and the same manifest on every rank
            manifest, digest, small[MANIFEST] = manifest_digest(path)
            meta, small[STATE] = verified_state(path, manifest)
            outcome = (OK, manifest["step"], digest, "")
        except CheckpointError as e:
            outcome = (INVALID, -1, "", str(e))
        code, why = _agree(*outcome)
        error = None
        if code == OK:  # 2. every rank loads its share, verifying what it reads
            loaded_any = True
            reader = None
            try:
                reader = open_checkpoint(path, verify=True, rank=rank, meta=meta, manifest=manifest)
                step = load(reader)
                mine = (OK, outcome[1], outcome[2], "")
            except CheckpointError as e:
                mine = (INVALID, outcome[1], outcome[2], str(e))
            except Exception as e:  # noqa: BLE001 - not the checkpoint's fault: every rank stops with it
                error, mine = e, (FAILED, outcome[1], outcome[2], f"{type(e).__name__}: {e}")
            read = {**small, **(getattr(reader, "bytes_read", None) or {})}
            code, why = _agree(*mine)
            if code == OK:
                _set_aside(rejected, warn, keep_aside and rank == 0)
                return Resumed(path, step, reader, read, spent, _max_over_ranks(sum(read.values())))
            spent += sum(read.values())
        else:
            spent += sum(small.values())
        if code == FAILED:
            raise CheckpointError(f"resuming from {path} failed: {why}") from error
        warn(f"skipping checkpoint {path.name}, which not every rank can verify: {why}")
        rejected.append((path, why))
    if rejected and (required or loaded_any):
        raise CheckpointError(f"{'ckpt.resume=true but ' if required else ''}no checkpoint in {root} verifies on "
                              f"every rank (newest: {rejected[0][1]}); nothing to resume, the checkpoints are left "
                              "as they are")
    if required:
        raise CheckpointError(f"ckpt.resume=true but {root} holds no checkpoint: nothing to resume")
    _set_aside(rejected, warn, keep_aside and rank == 0)
    return None


def _agree(code: int, step: int, digest: str, why: str) -> tuple[int, str]:
    """Every rank's outcome for one candidate, in one all-reduce (MAX): the worst code, and the message of the
    lowest rank with it (broadcast from that rank); ranks that see different steps or manifest digests are a
    checkpoint no rank may resume from."""
    rank, world = dist.get_rank(), dist.get_world_size()
    words = [int.from_bytes(bytes.fromhex(digest)[i:i + 7], "big") for i in range(0, 28, 7)] if digest else [0] * 4
    key = code * (world + 1) + (world - rank) if code else 0
    status = torch.tensor([key, step, -step, *words, *(-w for w in words)], dtype=torch.int64,
                          device=exchange_device())
    dist.all_reduce(status, op=dist.ReduceOp.MAX)
    status = status.tolist()
    if status[0]:
        worst, first = divmod(status[0], world + 1)
        message = [why if rank == world - first else None]
        dist.broadcast_object_list(message, src=world - first)
        return worst, f"rank {world - first}: {message[0]}"
    if status[1] != -status[2] or any(status[3 + i] != -status[7 + i] for i in range(4)):
        return INVALID, "the ranks see different manifests (another write or rename under way?)"
    return OK, ""


def _max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=exchange_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _set_aside(rejected: list[tuple[Path, str]], warn: Callable[[str], Any], enabled: bool) -> None:
    """Rename each rejected checkpoint aside (every rank has moved past them), keeping the evidence."""
    if not enabled:
        return
    for path, _ in rejected:
        try:
            warn(f"kept the checkpoint not every rank could verify as {set_aside(path).name}")
        except OSError:
            pass  # another process of the run set it aside first
