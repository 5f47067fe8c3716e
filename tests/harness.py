"""Run a test function on N ranks of a gloo process group, reusing worker processes.

Starting a process that imports torch costs seconds on a 2-core machine, so workers
are started once per world size (lazily, with the spawn start method) and kept for the
whole pytest session. Each worker joins a gloo default process group and then serves
calls: ``run_on_ranks(world_size, fn, *args, **kwargs)`` sends ``(fn, args, kwargs)``
to every rank, each runs ``fn`` and sends back its return value or its traceback.

``fn`` is pickled by reference, so it must be a module-level function of an importable
module -- usually the test module itself (the tests directory is a package and the
repository root is on ``sys.path``, which spawned workers inherit).

Failure modes never hang the suite:
  * a rank raises -> ``AssertionError`` naming the rank, with its traceback; ranks still
    running get a short grace period, then the pool is replaced;
  * the call takes longer than ``timeout`` -> the pool is killed (recreated on the next
    call) and ``TimeoutError`` names the function;
  * a worker dies -> ``RuntimeError`` with its exit code, and the pool is replaced.

Every worker runs with :mod:`tests.device_guard` installed: a tensor handed to a collective of a
group whose backend does not serve its device (a CPU tensor on an NCCL group, as it would run on a
GPU machine; ``device_guard.declared_backend`` lets a test declare a group's backend) fails the test
with ``DeviceGuardError``.

Between calls the workers meet at a ``dist.barrier()``, so a test starts clean. A test
that needs its own process group can create one with ``dist.new_group`` (all ranks of
the pool take part).
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from shardwise.dist import free_port

_GRACE_S = 10.0
"""After one rank fails, how long the others may take to finish before the pool is replaced."""

_PG_TIMEOUT_S = 120.0
"""gloo's own collective timeout inside the workers: a backstop behind ``timeout``."""


def _worker(rank: int, world_size: int, port: int, conn, sys_path: list[str]) -> None:
    """Body of one worker process: join the gloo group, then serve calls until told to stop."""
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=world_size, is_master=False,
                          timeout=timedelta(seconds=_PG_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=_PG_TIMEOUT_S))
    from tests import device_guard

    device_guard.install()  # a tensor on a device its group's backend cannot take fails the test
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            break
        if payload == b"stop":
            os._exit(0)  # skip tearing down the gloo group: nothing is left to flush, and peers are leaving too
        try:
            fn, args, kwargs = pickle.loads(payload)
            dist.barrier()
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            reply = ("error", traceback.format_exc())
        try:
            out = pickle.dumps(reply)
        except Exception:  # noqa: BLE001
            out = pickle.dumps(("error", f"rank {rank}: the return value cannot be pickled:\n{traceback.format_exc()}"))
        conn.send_bytes(out)
        try:  # after the reply (a failure is reported at once): every rank is done with the call's groups
            dist.barrier()
        except Exception:  # noqa: BLE001 - a rank died or is stuck: the parent replaces the pool
            continue
        _destroy_subgroups(dist)
    os._exit(0)


def _destroy_subgroups(dist) -> None:
    """Destroy every process group a call made (a run's mesh axes, ZeRO++'s node groups, ...), keeping the default
    one: each gloo group keeps three threads polling its sockets, and a pool serves hundreds of runs."""
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD and group is not distributed_c10d.GroupMember.WORLD:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - a group torch already tore down
                pass


class _Pool:
    """``world_size`` worker processes joined in one gloo group, served over pipes."""

    def __init__(self, world_size: int, start_timeout: float = 120.0):
        import torch.distributed as dist

        self.world_size = world_size
        ctx = mp.get_context("spawn")
        # The parent hosts the rendezvous store, so no port can be taken between choosing and binding it.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True, wait_for_workers=False)
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, self.store.port, child, list(sys.path)),
                               daemon=True, name=f"harness-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        replies = self._collect("worker start-up", start_timeout)
        bad = [r for r, (status, _) in replies.items() if status != "ready"]
        if bad:
            self.close()
            raise RuntimeError(f"harness workers {bad} failed to start")

    def call(self, fn, args, kwargs, timeout: float) -> list:
        name = getattr(fn, "__qualname__", repr(fn))
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self.conns:
            conn.send_bytes(payload)
        replies = self._collect(name, timeout)
        failed = [(r, tb) for r, (status, tb) in sorted(replies.items()) if status == "error"]
        if failed:
            parts = [f"--- rank {r} traceback ---\n{tb}" for r, tb in failed]
            ranks = ", ".join(str(r) for r, _ in failed)
            raise AssertionError(f"{name} failed on rank {ranks} of {self.world_size}:\n" + "\n".join(parts))
        return [replies[r][1] for r in range(self.world_size)]

    def _collect(self, name: str, timeout: float) -> dict[int, tuple]:
        """Wait for one reply per rank. Replaces the pool (``self.broken``) on timeout, death or partial failure."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        failed_at = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + _GRACE_S)
            if now >= limit:
                missing = [r for r in range(self.world_size) if r not in replies]
                self.close(kill=True)
                if failed_at is not None:  # some rank failed; the others are stuck waiting for it
                    for r in missing:
                        replies[r] = ("error", f"rank {r} did not finish within {_GRACE_S:.0f} s after another "
                                               "rank failed (stuck in a collective?)")
                    return replies
                raise TimeoutError(
                    f"{name} did not finish on {self.world_size} ranks within {timeout:g} s "
                    f"(ranks {missing} still running); the worker pool was killed and will be restarted"
                )
            waiting = {self.conns[r]: r for r in range(self.world_size) if r not in replies}
            sentinels = {self.procs[r].sentinel: r for r in waiting.values()}
            ready = wait([*waiting, *sentinels], timeout=limit - now)
            for obj in ready:
                if obj in waiting:
                    r = waiting[obj]
                    try:
                        replies[r] = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        continue  # the process died; its sentinel reports it
                    if replies[r][0] == "error" and failed_at is None:
                        failed_at = time.monotonic()
                elif obj in sentinels:
                    r = sentinels[obj]
                    if r in replies or self.conns[r].poll():
                        continue
                    self.procs[r].join(timeout=5)
                    code = self.procs[r].exitcode
                    self.close(kill=True)
                    raise RuntimeError(f"{name}: harness worker rank {r} died (exit code {code}); pool restarted")
        if failed_at is not None:  # everyone answered, but the group saw an error: start afresh to be safe
            self.close()
        return replies

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for conn in self.conns:
                try:
                    conn.send_bytes(b"stop")
                except (OSError, ValueError):
                    pass
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


_POOLS: dict[int, _Pool] = {}


def run_on_ranks(world_size: int, fn, *args, timeout: float = 300, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size``-rank gloo group.

    Returns the per-rank return values, indexed by rank. Inside ``fn`` the default
    process group is initialised (``dist.get_rank()`` is the rank), one intra-op thread.
    """
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.call(fn, args, kwargs, timeout)
    finally:
        if not pool.alive:
            _POOLS.pop(world_size, None)


def close_pool(world_size: int) -> None:
    """Stop the pool of ``world_size`` ranks, if one runs (a later call starts a new one)."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


def shutdown_pools() -> None:
    """Stop every worker pool (at the end of the test session)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_pools)

__all__ = ["close_pool", "free_port", "run_on_ranks", "shutdown_pools"]
