"""A guard, installed in every harness worker, that fails a test when a tensor reaches a collective
of a process group whose backend cannot take the tensor's device.

Under NCCL a CPU tensor handed to a collective fails ("No backend type associated with device
type cpu"), but on the gloo groups of the test suite the same call passes, so such a bug would only
show on a GPU machine. The guard wraps ``torch.distributed``'s collectives and point-to-point calls
(both the public names and ``distributed_c10d``'s, which torch's own helpers such as
``all_gather_object`` call) and checks each tensor's device type against the device types the
group's backend serves (``dist.get_backend_config``: "cpu:gloo,cuda:gloo" for gloo,
"cpu:gloo,cuda:nccl" for shardwise's NCCL default group, "cuda:nccl" for an NCCL-only group).

A test can *declare* what a group's backend is, to check on CPU that code would be legal on a GPU
machine: inside ``declared_backend(group, "cuda:nccl")`` the guard treats ``group`` as NCCL-only,
so any CPU tensor sent on it fails the test with :class:`DeviceGuardError`. A CUDA tensor handed to
gloo's point-to-point (which takes CPU tensors only) fails it too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

GUARDED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
           "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
           "isend", "irecv", "batch_isend_irecv", "all_gather_single", "reduce_scatter_single")
"""The torch.distributed functions the guard wraps (those absent in this torch are skipped)."""


GLOO_CPU_ONLY = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
"""gloo's point-to-point takes CPU tensors only (the backend table of the torch.distributed docs: gloo
GPU send/recv ✘), although gloo serves CUDA tensors for all-reduce and broadcast."""


class DeviceGuardError(RuntimeError):
    """A tensor on a device the group's backend does not serve reached a collective."""


_declared: dict[str, str] = {}
"""group name -> declared backend config (only inside :func:`declared_backend`; test workers only)."""


def _config(group) -> str:
    group = group if group is not None else c10d._get_default_group()
    return _declared.get(group.group_name) or dist.get_backend_config(group)


@contextlib.contextmanager
def declared_backend(group, config: str):
    """Treat ``group`` (``None``: the default group) as created with backend ``config`` meanwhile."""
    name = (group if group is not None else c10d._get_default_group()).group_name
    before = _declared.get(name)
    _declared[name] = config
    try:
        yield
    finally:
        if before is None:
            _declared.pop(name, None)
        else:
            _declared[name] = before


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def check(name: str, tensors, group) -> None:
    """Raise :class:`DeviceGuardError` unless every tensor's device type is served on ``group``."""
    config = _config(group)
    backends = {part.split(":", 1)[0].strip(): part.split(":", 1)[1].strip()
                for part in config.split(",") if ":" in part}
    for t in tensors:
        kind = t.device.type
        if kind not in backends:
            raise DeviceGuardError(
                f"torch.distributed.{name}: a {kind} tensor {tuple(t.shape)} {t.dtype} reached a group "
                f"whose backend ({config}) serves only {', '.join(sorted(backends))} tensors")
        if kind != "cpu" and backends[kind] == "gloo" and name in GLOO_CPU_ONLY:
            raise DeviceGuardError(
                f"torch.distributed.{name}: a {kind} tensor {tuple(t.shape)} {t.dtype} reached gloo's "
                f"point-to-point ({config}), which takes CPU tensors only")


def _guarded(name: str, fn):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if name == "batch_isend_irecv":
            for op in args[0] if args else kwargs.get("p2p_op_list", []):
                check(name, [op.tensor], op.group)
        else:
            bound = sig.bind_partial(*args, **kwargs)
            group = bound.arguments.get("group")
            tensors = [t for k, v in bound.arguments.items() if k != "group" for t in _tensors(v)]
            check(name, tensors, group)
        return fn(*args, **kwargs)

    wrapper.device_guard = True
    return wrapper


def install() -> None:
    """Wrap every function of :data:`GUARDED` in ``torch.distributed`` and ``distributed_c10d`` (idempotent)."""
    for name in GUARDED:
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None or getattr(fn, "device_guard", False):
            continue
        guarded = _guarded(name, fn)  # one object under both names: P2POp checks `op in (isend, irecv)`
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, guarded)


def installed() -> bool:
    return getattr(dist.all_reduce, "device_guard", False) and getattr(c10d.all_gather, "device_guard", False)
