"""No host synchronisation in the steady-state training step of dense layouts (bf16 / fp32).

A host synchronisation is an operation that makes the host wait for the device to reach it: reading a
tensor's value (``.item()``, ``float()``, ``bool()``, ``.tolist()``), or an operator whose output shape depends
on the data (``nonzero``, ``masked_select``, ``unique``). On a GPU each one drains the launch queue; on the CPU
they are as visible, to a dispatch mode that watches the operators of a step (:class:`HostSyncs`). The step's
metrics are read once, one step late, from a host copy (``shardwise.train.readout``) whose read is not one of
these operators. What this cannot see on a CPU: a ``.cpu()`` of a tensor already on the CPU, a blocking
host-to-device copy of the batch.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import run_on_ranks
from tests.test_train import make_config

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.equal, aten.masked_select,
            aten._unique2, aten.unique_consecutive, aten.unique_dim}
"""The operators that read a value on the host, or whose output shape depends on the data."""

STEPS, WARMUP = 5, 2
"""Steps [WARMUP, STEPS - 1) are watched: after the first steps (optimizer state, memory table) and before the
last (final evaluation and checkpoint)."""


def _call_site() -> str:
    """The innermost frame of shardwise's own code on the stack: where the synchronisation comes from."""
    for frame in reversed(traceback.extract_stack()):
        if "/shardwise/" in frame.filename:
            return f"{frame.filename.rsplit('/shardwise/', 1)[1]}:{frame.lineno} {frame.name}"
    return "?"


class HostSyncs(TorchDispatchMode):
    """Counts host synchronisations by call site while ``self.step`` is in ``watched``."""

    def __init__(self, watched: range):
        super().__init__()
        self.watched, self.step = watched, -1
        self.sites: Counter[str] = Counter()

    def note(self, kind: str) -> None:
        if self.step in self.watched:
            self.sites[f"{kind} at {_call_site()}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in SYNC_OPS:
            self.note(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watching_steps(watched: range):
    """A :class:`HostSyncs` over the training loop; the step it is in comes from the sampler's per-step call,
    and ``Tensor.tolist`` (which reads memory without an operator on the CPU) is counted too."""
    from shardwise.data import DistributedWindowSampler

    mode = HostSyncs(watched)
    micro_batches, tolist = DistributedWindowSampler.micro_batches, torch.Tensor.tolist

    def step_start(self, step, *args, **kwargs):
        mode.step = step
        return micro_batches(self, step, *args, **kwargs)

    def counted_tolist(self, *args, **kwargs):
        mode.note("Tensor.tolist")
        return tolist(self, *args, **kwargs)

    DistributedWindowSampler.micro_batches, torch.Tensor.tolist = step_start, counted_tolist
    try:
        with mode:
            yield mode
    finally:
        DistributedWindowSampler.micro_batches, torch.Tensor.tolist = micro_batches, tolist


def _count_syncs(cfg, run_dir: str) -> dict[str, int]:
    from shardwise.train.loop import train

    with watching_steps(range(WARMUP, STEPS - 1)) as mode:
        train(cfg, Path(run_dir))
    return dict(mode.sites)


@pytest.mark.parametrize(("nproc", "precision"), [(1, "bf16"), (2, "fp32"), (2, "fp16")])
def test_dense_step_has_no_host_synchronisation(tmp_path, cache_dir, nproc, precision):
    cfg = make_config(tmp_path, cache_dir, nproc, **{"train.steps": STEPS, "train.precision": precision})
    for rank, sites in enumerate(run_on_ranks(nproc, _count_syncs, cfg, str(tmp_path))):
        assert not sites, f"rank {rank}: host synchronisations in steps {WARMUP}..{STEPS - 2}: {sites}"
