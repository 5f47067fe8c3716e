"""Name the collective that failed and the ranks that did not answer, when a worker's collective fails.

A hung or dead peer surfaces as a timeout or a closed connection deep inside the backend: gloo says
``Timed out waiting 3000ms for recv operation to complete`` and names neither the collective nor the
peer. Every collective is bounded (``parallel.timeout_s`` for the process group's, ``comm.timeout_s``
for ours, whose ``TimeoutError`` names the collective and algorithm), so a hung peer always ends in an
exception; :func:`diagnosed` turns it into one line:

    all_reduce (parallel/data.py:123 in _finish) failed on rank 0: ranks not answering: [1];
    backend: Timed out waiting 3000ms for recv operation to complete

* the collective is the outermost ``torch.distributed`` function on the failing stack (the public call,
  e.g. ``all_gather_object`` rather than the ``all_gather`` it runs), or ``wait()`` on an asynchronous
  handle, with the first frame of our code that called it; our own collectives name themselves;
* the missing ranks come from a roll call on the job's key-value store (the TCPStore of the rendezvous,
  which outlives the process group's connections): every rank that reaches the failure handler writes
  ``rollcall/<attempt>/<rank>`` and waits a few seconds for the others; whoever has not written is
  missing (hung, stopped or dead). This is the idea of ``torch.distributed.monitored_barrier`` (which
  reports the ranks that miss a barrier) on the store instead of the failed process group.

The failing rank then exits with that error; torch's elastic agent stops the group and, with
``run.max_restarts``, starts it again (:mod:`shardwise.train.recovery`).
"""

from __future__ import annotations

import os
import re
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

_MARKERS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset", "Broken pipe",
            "point-to-point transfer failed", "DistBackendError", "gloo", "NCCL")


_OWN_NAME = re.compile(r"^([a-z_]+/[a-z_0-9]+): ")


class CollectiveFailure(RuntimeError):
    """A collective failed (timed out or lost a peer); the message names it and the missing ranks."""


def is_collective_failure(exc: BaseException) -> bool:
    """A timeout of ours, or a backend error from torch.distributed (by type or by the backend's words)."""
    if isinstance(exc, TimeoutError):
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS)


def failed_collective(exc: BaseException) -> str:
    """``name (file:line in function)`` of the collective on ``exc``'s stack, from the traceback."""
    own = _OWN_NAME.match(str(exc))  # our collectives name themselves ("all_reduce/ring: timed out ...")
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dist = [i for i, f in enumerate(frames) if _inside(f.filename, _TORCH_DIST_DIR)
                  and f.name not in ("wrapper", "_wrapper", "inner")]
    ours = [i for i, f in enumerate(frames) if _inside(f.filename, _PACKAGE_DIR)]
    if own:
        name = own.group(1)
        callers = [i for i in ours if not _inside(frames[i].filename, os.path.join(_PACKAGE_DIR, "dist", "comm"))]
    elif torch_dist:
        name = frames[torch_dist[0]].name
        callers = [i for i in ours if i < torch_dist[0]]
    else:
        name = "wait()" if frames and frames[-1].line and ".wait(" in frames[-1].line else "collective"
        callers = ours
    if not callers:
        return name
    f = frames[callers[-1]]
    where = os.path.relpath(os.path.realpath(f.filename), _PACKAGE_DIR)
    return f"{name} ({where}:{f.lineno} in {f.name})"


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
"""This package's own directory (``.../shardwise``, this file being ``shardwise/dist/diagnose.py``): frames under
it are ours, wherever the project is cloned -- a path such as ``/home/me/shardwise/.venv/lib/.../torch/...``
holds ``/shardwise/`` too, but is not ours."""
_TORCH_DIST_DIR = os.path.dirname(os.path.realpath(dist.__file__))


def _inside(filename: str, directory: str) -> bool:
    """Whether ``filename`` (a frame's) lies under ``directory`` (both resolved, so links do not matter)."""
    return os.path.realpath(filename).startswith(directory + os.sep)


def job_store(world: int, wait_s: float, attempt: str = "0"):
    """A client of the job's TCPStore (torchrun's ``MASTER_ADDR:MASTER_PORT``), namespaced for the roll
    call of this attempt; None outside a torchrun-style environment or when the store does not answer."""
    if world <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                              is_master=False, timeout=timedelta(seconds=max(wait_s, 1.0)),
                              wait_for_workers=False)
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None
    return dist.PrefixStore(f"rollcall/{attempt}", store)


def roll_call(store, rank: int, world: int, wait_s: float) -> list[int] | None:
    """Write this rank's key, then return the ranks whose keys are still absent after ``wait_s`` seconds
    (all present: returns as soon as they are); None when ``store`` is None or fails."""
    if store is None:
        return None
    try:
        store.set(str(rank), "here")
        deadline = time.monotonic() + wait_s
        missing = list(range(world))
        while True:
            missing = [r for r in missing if not store.check([str(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a diagnostic only: the original error is still raised
        return None


def describe(exc: BaseException, rank: int, world: int, wait_s: float, store=None) -> str:
    """The one-line explanation of a collective failure on ``rank`` (roll call on ``store``, default the
    job's store)."""
    if store is None:
        store = job_store(world, wait_s, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    missing = roll_call(store, rank, world, wait_s)
    who = "unknown (the job's store did not answer)" if missing is None else \
        (str(missing) if missing else "none (every rank reached the failure handler)")
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    detail = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", detail)  # gloo's "[.../unbound_buffer.cc:78] "
    return f"{failed_collective(exc)} failed on rank {rank}: ranks not answering: {who}; backend: {detail}"


def diagnosed(fn: Callable[[], object], on_failure: Callable[[str], None] | None = None,
              wait_s: float = 5.0) -> object:
    """Run ``fn``; a collective failure is re-raised as :class:`CollectiveFailure` with :func:`describe`'s
    line (also passed to ``on_failure``, e.g. to record it in the run directory). Other exceptions pass
    through unchanged (their last line also goes to ``on_failure``)."""
    try:
        return fn()
    except Exception as exc:
        if not is_collective_failure(exc) or not dist.is_initialized():
            if on_failure is not None:
                on_failure(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}")
            raise
        line = describe(exc, dist.get_rank(), dist.get_world_size(), wait_s)
        if on_failure is not None:
            on_failure(line)
        raise CollectiveFailure(line) from exc


def run_dir_recorder(run_dir: Path) -> Callable[[str], None]:
    """``on_failure`` for :func:`diagnosed` that appends the line to the run's ``failures.jsonl``."""
    from shardwise.train.recovery import record_failure

    return lambda line: record_failure(run_dir, int(os.environ.get("RANK", "0")), line)
