"""A step's device values read on the host one step late, so the training step never waits for the device.

Reading a device tensor's value on the host (``.item()``, ``float()``, ``bool()``) makes the host wait until the
device has run everything queued before it: the launches of the next step cannot be queued while the device
works, and the device idles while the host catches up. The loop instead hands each step's values (loss,
gradient norm, learning rate, the skip verdict, ...) to :class:`Readout`: they are stacked into one small
vector, copied to host memory without waiting (``non_blocking`` into pinned memory, a CUDA event recorded
after the copy), and read after the *next* step has been queued -- when the device is past them. On a CPU the
vector is the host copy. Torchtitan and Megatron-LM log their metrics the same way (gathered and read only
every few steps) for the same reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PendingStep:
    """One step's values on their way to the host, and what the loop keeps with them until they are read."""

    step: int
    names: list[str]
    host: torch.Tensor
    event: Any | None
    keep: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReadStep:
    """One step's values, read: ``values`` by name (Python floats), and what the loop kept with them."""

    step: int
    values: dict[str, float]
    keep: dict[str, Any]


class Readout:
    """Steps' device values, queued to the host without waiting and read one step later (oldest first)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pending: deque[PendingStep] = deque()

    def push(self, step: int, values: dict[str, torch.Tensor], **keep) -> None:
        """Queue ``values`` (0-dim tensors on the device) of ``step`` for the host; nothing waits. ``keep``: what
        the loop wants back with them (host numbers, or device tensors for a later look)."""
        scalars = [v.detach().reshape(()) if v.requires_grad or v.dim() else v for v in values.values()]
        # one operator: stack promotes the dtypes (float64 where one is: then .double() dispatches nothing)
        vector, event = copy_to_host(torch.stack(scalars).double())
        self._pending.append(PendingStep(step, list(values), vector, event, keep))

    def ready(self) -> list[ReadStep]:
        """Every queued step but the newest, read: the device has queued work after them, so waiting for them
        leaves it busy."""
        return [self._read(self._pending.popleft()) for _ in range(len(self._pending) - 1)]

    def drain(self) -> list[ReadStep]:
        """Every queued step, read (waits for the newest: before a checkpoint, at the end)."""
        return [self._read(self._pending.popleft()) for _ in range(len(self._pending))]

    @staticmethod
    def _read(p: PendingStep) -> ReadStep:
        if p.event is not None:
            p.event.synchronize()
        numbers = p.host.numpy().tolist()  # host memory: no device to wait for
        return ReadStep(p.step, dict(zip(p.names, numbers, strict=True)), p.keep)


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``t``'s copy in host memory, queued without waiting, and on a GPU the event to synchronize on before the copy
    is read (``None``: ``t`` was on the host; the copy is ``t`` itself, still made by ``.to``, which is where a
    simulated device, :mod:`shardwise.dispatch_count`, learns that it is a host tensor)."""
    on_cuda = t.is_cuda
    host = t.to("cpu", non_blocking=True)  # from a GPU into pinned host memory
    if not on_cuda:
        return host, None
    event = torch.cuda.Event()
    event.record()
    return host, event


class Late:
    """A metric entry whose values are computed when its step is read: ``read()`` returns them (a dict) from host
    copies queued without waiting during the step (e.g. the routers' load, :func:`~shardwise.parallel.expert.
    router_step.router_step`)."""

    def __init__(self, read: Callable[[], dict[str, Any]]):
        self.read = read


def resolve_late(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with every :class:`Late` entry replaced by the values it reads (call after the step's read)."""
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, Late):
            out.update(value.read())
        else:
            out[name] = value
    return out
