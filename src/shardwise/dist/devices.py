"""Which devices a process group's backend serves, and where each kind of exchange should live.

A process group created with one backend name serves the device types that backend takes:
"nccl" only CUDA tensors ("No backend type associated with device type cpu" otherwise), "gloo"
CPU tensors (and CUDA tensors for some collectives). torch.distributed lets one group hold one
backend per device type (``"cpu:gloo,cuda:nccl"``, the ``BackendConfig`` of
``torch.distributed.distributed_c10d``): a collective is dispatched by its tensors' device. With
nccl, :func:`shardwise.dist.mesh.init_distributed` creates the default group that way, so the
small exchanges that live on the CPU (RNG states at a checkpoint, the metadata checks of our
collective algorithms, the cost model's agreement) go over gloo while gradients and activations go
over nccl; ``dist.new_group`` and ``DeviceMesh`` inherit the default group's backend string.

:func:`exchange_device` and :func:`data_device` let code that creates a tensor for a collective
put it where the group can take it, whatever the group was created with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def process_group_backend(backend: str) -> str:
    """The backend string to create a default group with: nccl gets gloo beside it for CPU tensors."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def parse_backend_config(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}`` (``get_backend_config``'s format)."""
    out = {}
    for part in str(config).split(","):
        if ":" in part:
            device, name = part.split(":", 1)
            out[device.strip()] = name.strip()
    return out


def group_backends(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """The backend serving each device type in ``group`` (``None``: the default group)."""
    return parse_backend_config(dist.get_backend_config(group))


def exchange_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small host-side exchange (metadata, RNG states, timings) on ``group`` should live:
    the CPU when the group serves CPU tensors, else the current CUDA device (an nccl-only group)."""
    if "cpu" in group_backends(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def data_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the data a group reduces lives (and what calibrating it should time): the current
    CUDA device when the group's CUDA backend is nccl, else the CPU."""
    if group_backends(group).get("cuda") == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU): for timing GPU work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
