"""Checkpoint writing, synchronous or in the background (``ckpt.async``), with the time each costs the run.

Synchronously (:func:`shardwise.train.sharded.save_sharded`) every rank writes its file and the group waits for
rank 0 to finish the checkpoint: training stops for the whole write. Asynchronously -- as torchtitan's
``torch.distributed.checkpoint.async_save`` and Megatron's asynchronous ``dist_checkpointing`` do -- each rank
returns to training at once and a background thread first copies the rank's pieces to host memory (on GPUs into
pinned buffers kept from one checkpoint to the next, by non-blocking copies on a side stream that waits for the
step's values, so the copy runs at the link's full speed beside the next step's kernels), then writes them into the
same temporary directory; rank 0's thread, once every rank's file is there, writes ``state.json`` and the manifest
and renames the directory into place exactly as a synchronous save does (:mod:`shardwise.train.checkpoint`). So a
crash during the background write leaves the previous checkpoint the newest valid one, and ``--resume``, failover
restarts and ``ckpt.keep`` see nothing new. The copy overlaps the next step's forward and backward, which read the
weights and optimizer state but do not change them; the next optimizer step waits for the copy to be done
(:meth:`CheckpointWriter.before_update`), so the checkpoint holds exactly the state of its step.

At most one write is in flight: the next checkpoint first waits for the previous one (and the end of the run
for the last). The background threads use no collective: the ranks meet through the file system -- each
writes a small ``.written-<rank>.json`` (its manifest entry and index, or its error) next to its file, which
rank 0's thread waits for (``parallel.timeout_s`` at most) -- so they never race the training's collectives.

Measured (``metrics.jsonl``): ``ckpt_stall_s``, the training time lost at a checkpoint step (collecting the
pieces and the JSON state, plus any wait for the previous write; the whole write when synchronous), logged for
the step the checkpoint is of; ``ckpt_wait_s``, time an optimizer step waited for the copy (logged with that
step when it had to wait: training time lost too); ``ckpt_write_s``, the copy and write on rank 0 from its start
to the rename (the slowest rank's file included), logged with the first step after it finished.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.train.checkpoint import CheckpointError, abandon_checkpoint, begin_checkpoint
from shardwise.train.sharded import Piece, finish_pieces, save_sharded, write_pieces

MARKER = ".written-{rank:05d}.json"
"""What each rank leaves next to its file in the temporary directory for rank 0 (removed before the manifest)."""


class PinnedStaging:
    """Pinned host buffers for the pieces of a GPU's checkpoints, kept from one checkpoint to the next (pinning
    memory is slow: ``cudaHostAlloc`` maps pages for the DMA engine), and the side stream that fills them.
    At most one write is in flight (:class:`CheckpointWriter`), so the buffers of one are free by the next."""

    def __init__(self):
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.stream: torch.cuda.Stream | None = None

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        pool = self.free.get((numel, dtype))
        return pool.pop() if pool else torch.empty(numel, dtype=dtype, pin_memory=True)

    def give_back(self, pieces: list[Piece]) -> None:
        for p in pieces:
            if p.values.is_pinned():
                self.free.setdefault((p.values.numel(), p.values.dtype), []).append(p.values)


def host_copy(pieces: list[Piece], staging: PinnedStaging | None = None, ready=None) -> list[Piece]:
    """The pieces' values in host memory, so training may change the originals while the copies are written.
    On a CPU a clone. From a GPU: non-blocking copies into pinned buffers (``staging``'s, reused) on a side
    stream, which first waits for ``ready`` (an event recorded on the compute stream when the checkpoint was
    asked for: the values of that step), then one wait for that stream alone -- the compute stream runs on."""
    staging = staging or PinnedStaging()
    out, sources = [], []
    for p in pieces:
        v = p.values.detach()
        if v.device.type != "cuda":
            out.append(Piece(p.key, v.clone(), p.start, p.shape))
            continue
        if staging.stream is None:
            staging.stream = torch.cuda.Stream(v.device)
        if not sources and ready is not None:
            staging.stream.wait_event(ready)
        host = staging.take(v.numel(), v.dtype)
        with torch.cuda.stream(staging.stream):
            host.copy_(v.reshape(-1), non_blocking=True)
        v.record_stream(staging.stream)  # the allocator keeps the source until the side stream has read it
        sources.append(v)
        out.append(Piece(p.key, host.view(v.shape), p.start, p.shape))
    if sources:
        staging.stream.synchronize()  # the copies are done before training may change the originals
    return out


class CheckpointWriter:
    """Writes checkpoints for one rank, synchronously or (``background``) one at a time in a thread."""

    def __init__(self, root: Path, keep: int, background: bool, timeout_s: float):
        self.root, self.keep, self.background, self.timeout_s = Path(root), keep, background, timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        """Set once the write in flight has its own copy of the pieces (set when none is in flight)."""
        self._copied.set()
        self._error: BaseException | None = None
        self._done: list[tuple[int, float]] = []
        """``(step, write seconds)`` of background writes finished and not yet reported."""
        self._staging = PinnedStaging()

    def save(self, step: int, pieces: list[Piece], meta: dict[str, Any] | None, after_write=None) -> float:
        """Checkpoint ``step`` (a collective: every rank calls it); returns the seconds training stood still."""
        t0 = time.perf_counter()
        if not self.background:
            save_sharded(self.root, step, pieces, meta, self.keep, after_write=after_write)
            write_s = time.perf_counter() - t0
            self._done.append((step, write_s))
            return write_s
        self.wait()  # at most one write in flight
        holder = [begin_checkpoint(self.root, step) if self.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        self._copied.clear()
        device = next((p.values.device for p in pieces if p.values.device.type == "cuda"), None)
        ready = None
        if device is not None:  # the step's values: the side stream starts copying once the compute stream is here
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._thread = threading.Thread(target=self._write, args=(Path(holder[0]), step, pieces, meta, after_write,
                                                                  device, ready), name=f"checkpoint-{step}",
                                        daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def before_update(self) -> float | None:
        """Called before an optimizer step changes the weights and moments: wait until the write in flight has
        copied them. Returns the seconds waited when a copy was still running, else None."""
        if self._copied.is_set():
            return None
        t0 = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - t0

    def _write(self, tmp: Path, step: int, pieces: list[Piece], meta, after_write, device, ready=None) -> None:
        t0 = time.perf_counter()
        try:
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # a new thread starts on device 0
                pieces = host_copy(pieces, self._staging, ready)
            finally:
                self._copied.set()
            written = write_pieces(tmp, self.rank, pieces)
            self._staging.give_back(pieces)
            del pieces
            if after_write is not None:
                after_write()
            _write_json(tmp / MARKER.format(rank=self.rank), written)
            if self.rank == 0:
                everyone = self._gather_markers(tmp, step)
                finish_pieces(self.root, step, tmp, everyone, meta, self.keep)
            elif written[2]:
                raise CheckpointError(f"checkpoint step {step} was not written: {written[2]}")
            self._done.append((step, time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001 - raised on the training thread at its next wait
            self._error = e

    def _gather_markers(self, tmp: Path, step: int) -> list:
        deadline = time.monotonic() + self.timeout_s
        paths = [tmp / MARKER.format(rank=r) for r in range(self.world)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(paths) if not p.exists()]
                abandon_checkpoint(tmp)
                raise CheckpointError(f"checkpoint step {step} was not written: ranks {missing} did not finish "
                                      f"their files within parallel.timeout_s={self.timeout_s}")
            time.sleep(0.01)
        everyone = [tuple(json.loads(p.read_text())) for p in paths]
        for p in paths:
            p.unlink()
        return everyone

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finished(self) -> list[tuple[int, float]]:
        """``(step, write seconds)`` of the writes finished since the last call (rank 0's are the checkpoint's)."""
        done, self._done = self._done, []
        return done


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)  # rank 0 never reads a marker half-written
