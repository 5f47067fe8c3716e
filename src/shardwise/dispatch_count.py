"""What a piece of training code costs a GPU's host, counted on any device: operators dispatched (each one a
kernel launch on a GPU), host synchronisations by kind and call site, collectives and their bytes, and the
Python time outside the operators.

Two of torch's interception points, one above the other (the extension points torch documents for this:
``torch.overrides.TorchFunctionMode`` sees every call of torch's Python API and of a tensor's methods, such as
``x.item()`` or ``x.cpu()``; ``torch.utils._python_dispatch.TorchDispatchMode`` every operator the
dispatcher runs below autograd, backward's included, such as ``aten::mm`` or ``c10d::allreduce_``):

* **operators**: every dispatched operator, views included (``ops``); ``device_ops`` those on device tensors
  and ``kernels`` the non-view ones among them -- what launches work on an accelerator;
* **host synchronisations** (the host waits until the device has caught up), by kind:
  ``scalar`` (``item()``, ``bool()``, ``int()``, ``float()`` of a device tensor, or a stray
  ``aten::_local_scalar_dense``), ``tolist``, ``to_host`` (``.cpu()``, ``.to("cpu")``, ``.numpy()``),
  ``to_device`` (a blocking copy from pageable host memory, e.g. ``torch.tensor(list, device=cuda)``:
  the copy waits for the stream), ``data_dependent`` (an operator whose output shape depends on the data:
  ``nonzero``, boolean indexing, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``,
  ``masked_select``, ``equal``); each with its **call site**, the innermost frame in shardwise (else the
  innermost outside torch);
* **collectives**: every ``c10d`` / functional-collective operator, with its bytes in the convention of the
  counting layer (:mod:`shardwise.dist.comm.counting`: the larger of its tensor arguments -- an all-reduce's
  tensor, a reduce-scatter's input, an all-gather's output, a message);
* **time**: the wall time of the window, the time inside operators, and the difference, the Python time.

On a GPU a tensor is a device tensor when it lives there. On a CPU nothing does, so the counter
*simulates* the device (``simulate=True``): every tensor counts as a device tensor except those the code
made on the host -- by ``.cpu()``, by a factory called without a ``device`` (``torch.arange(n)``,
``torch.tensor(list)``), or by an operation whose tensor inputs all live on the host (tracked by weak
reference). A read of a host tensor is free on any machine and is not counted; a read of a device tensor is
counted as the synchronisation it would be on a GPU. The simulation is an approximation: a tensor made on
the host before the counter started counts as a device tensor (:meth:`DispatchCounter.on_host` says otherwise;
:class:`CallWindow` tracks where tensors live from the loop's first cycle on, so a host copy made in one cycle and
read in the next -- a metric read one step late -- is known to be one).

Autograd runs the hooks of a backward (gradient reduction, ZeRO's callbacks) inside ``Tensor.backward``; torch
switches a function mode off while it handles a call, so the counter runs ``backward`` and ``autograd.grad``
under itself again: a ``.tolist()`` or ``.cpu()`` in a backward hook is seen like one in the forward.

:class:`CallWindow` counts one cycle of a loop from outside it (between two calls of a method, e.g. the trainer's
``Engine.forward_backward``): how ``bench/bench_dispatch.py`` counts one steady-state step of the real loop, and
``tests/test_step_syncs.py`` holds every layout's step to no synchronisation.

Counting costs about ten microseconds per operator (both modes are Python); the Python time it reports
includes that, the same for every code measured side by side.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

KINDS = ("scalar", "tolist", "to_host", "to_device", "data_dependent")
"""The kinds of host synchronisation (module docstring)."""

_SCALAR_READS = {"item", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
_HOST_COPIES = {"cpu", "numpy", "__array__"}
_DATA_DEPENDENT = {"aten::nonzero", "aten::masked_select", "aten::unique_dim", "aten::_unique", "aten::_unique2",
                   "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount", "aten::equal",
                   "aten::is_nonzero"}
_BOOL_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
"""Calls whose Python bodies run autograd's hooks: the function level runs them under itself again."""
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PACKAGE = str(Path(__file__).resolve().parent)
_TORCH = str(Path(torch.__file__).resolve().parent)
_HERE = str(Path(__file__).resolve())


@dataclass
class Counts:
    """What one window dispatched (module docstring); :meth:`to_dict` for JSON."""

    ops: int = 0
    device_ops: int = 0
    kernels: int = 0
    by_op: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    """``(kind, site) -> count``."""
    collectives: Counter = field(default_factory=Counter)
    """Collective operator name -> calls."""
    collective_bytes: int = 0
    wall_s: float = 0.0
    op_s: float = 0.0

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())

    def syncs_by_kind(self) -> dict[str, int]:
        out: Counter = Counter()
        for (kind, _site), n in self.syncs.items():
            out[kind] += n
        return dict(out)

    def syncs_by_site(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, site), n in sorted(self.syncs.items(), key=lambda kv: kv[0][1]):
            out.setdefault(site, {})[kind] = n
        return out

    def to_dict(self, top_ops: int = 15) -> dict:
        return {"ops": self.ops, "device_ops": self.device_ops, "kernels": self.kernels,
                "syncs": self.n_syncs, "syncs_by_kind": self.syncs_by_kind(), "syncs_by_site": self.syncs_by_site(),
                "collectives": sum(self.collectives.values()), "collective_bytes": self.collective_bytes,
                "collectives_by_name": dict(self.collectives), "top_ops": dict(self.by_op.most_common(top_ops)),
                "wall_s": self.wall_s, "op_s": self.op_s, "python_s": max(self.wall_s - self.op_s, 0.0)}


def call_site() -> str:
    """``file:line (function)`` of the innermost frame in shardwise outside this module, else the innermost frame
    outside torch (a benchmark's own loop)."""
    frame = sys._getframe(1)
    outside = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _HERE and not name.startswith(_TORCH):
            if name.startswith(_PACKAGE):
                return f"{Path(name).relative_to(Path(_PACKAGE).parent)}:{frame.f_lineno} ({frame.f_code.co_name})"
            outside = outside or f"{Path(name).name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return outside or "?"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _target(args, kwargs) -> tuple[object, bool]:
    """The device a ``Tensor.to`` call names (None: it names a dtype only) and its ``non_blocking``."""
    device = kwargs.get("device")
    non_blocking = bool(kwargs.get("non_blocking", False))
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) and device is None:
            device = a
        elif isinstance(a, torch.Tensor) and device is None:
            device = a.device
        elif isinstance(a, bool):
            non_blocking = a
    return device, non_blocking


class DispatchCounter:
    """Count what the code run between :meth:`start` and :meth:`stop` (or inside ``with``) dispatches on this
    thread. ``simulate``: treat tensors as device tensors as the module docstring says (default: when counting
    on a CPU, ``device`` None or "cpu")."""

    def __init__(self, device: str | torch.device | None = None, simulate: bool | None = None):
        kind = torch.device(device).type if device is not None else "cpu"
        self.simulate = kind == "cpu" if simulate is None else simulate
        self.counts = Counts()
        self.counting = False
        """False while the counter only tracks where tensors live (:meth:`start` with ``counting=False``)."""
        self._host = WeakIdKeyDictionary()
        self._reading = 0
        self._host_call = 0
        self._quiet = 0
        self._modes: tuple | None = None
        self._t0 = 0.0

    # ---- which tensors live where ------------------------------------------------------------------------------

    def on_device(self, t: torch.Tensor) -> bool:
        if t.device.type == "meta":
            return True
        if self.simulate:
            return t not in self._host
        return t.device.type != "cpu"

    def _mark_host(self, out) -> None:
        for t in _tensors(out):
            self._host[t] = True

    def _host_alias(self, out, source: torch.Tensor | None):
        """``out``, or where a simulated download returned its own input (``.cpu()`` of a CPU tensor), a new view
        of it: the copy lives on the host, the original stays a device tensor."""
        if out is not source or source is None:
            return out
        self._quiet += 1
        try:
            return source.view_as(source)
        finally:
            self._quiet -= 1

    def _names_host(self, device) -> bool:
        """Whether a ``device`` argument puts a tensor on the host."""
        if device is None:
            return True
        if self.simulate:
            return isinstance(device, str) and device.startswith("cpu")
        return torch.device(device).type == "cpu"

    def on_host(self, tensors) -> None:
        """Say that ``tensors`` (made before the window) live on the host, e.g. an optimizer's step counts, which
        torch keeps on the CPU unless the optimizer is fused or capturable (simulated device only)."""
        self._mark_host(list(tensors))

    def sync(self, kind: str) -> None:
        if self.counting:
            self.counts.syncs[(kind, call_site())] += 1

    # ---- the window ----------------------------------------------------------------------------------------------

    def start(self, counting: bool = True) -> DispatchCounter:
        """Intercept from here on (again: no-op); ``counting`` False only tracks where new tensors live, until a
        later ``start()`` begins counting."""
        if self._modes is None:
            self._modes = (_FunctionLevel(self), _DispatchLevel(self))
            for mode in self._modes:
                mode.__enter__()
        if counting and not self.counting:
            self.counting = True
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> Counts:
        if self.counting:
            self.counts.wall_s += time.perf_counter() - self._t0
        self.counting = False
        for mode in reversed(self._modes or ()):
            mode.__exit__(None, None, None)
        self._modes = None
        return self.counts

    def __enter__(self) -> DispatchCounter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class CallWindow:
    """Count one cycle of a loop from outside it: from the ``first``-th call (0-based) of ``cls.method`` to the next
    call (or :meth:`close`), e.g. ``CallWindow(Engine, "forward_backward", 2)`` around ``train(...)`` counts the
    loop's third step whole -- upload, forward, backward, norm, optimizer, metrics -- whatever the loop does
    between. From the first call on the counter tracks where tensors live (the earlier cycles' host copies are
    host tensors in the counted one). The method is wrapped on the class in this process until :meth:`close`;
    ``on_open(obj, counter)`` runs as the window opens (e.g. to mark tensors made before the first call as host
    tensors: :meth:`DispatchCounter.on_host`)."""

    def __init__(self, cls, method: str, first: int, device: str | torch.device | None = None, on_open=None):
        self.counter, self.calls, self.open, self.first = DispatchCounter(device), 0, False, first
        original = getattr(cls, method)

        def wrapped(obj, *args, **kwargs):
            if self.open and self.counter.counting:  # the counted cycle ends
                self.counter.stop()
                self.open = False
            elif self.calls <= first:  # tracking from the first call, counting from the ``first``-th
                self.counter.start(counting=self.calls == first)
                self.open = True
                if on_open is not None and self.calls == first:
                    on_open(obj, self.counter)
            self.calls += 1
            return original(obj, *args, **kwargs)

        setattr(cls, method, wrapped)
        self._restore = lambda: setattr(cls, method, original)

    def close(self) -> Counts | None:
        """The counts (None: the window never opened); the method is unwrapped."""
        if self.open:
            self.counter.stop()
            self.open = False
        self._restore()
        return self.counter.counts if self.calls > self.first else None


def optimizer_steps(optimizer) -> list[torch.Tensor]:
    """The step counts in an optimizer's state (a ZeRO optimizer's inner one's), which torch keeps on the CPU unless
    the optimizer is fused or capturable: for :meth:`DispatchCounter.on_host` when simulating a device."""
    inner = getattr(optimizer, "inner", optimizer)
    return [s["step"] for s in getattr(inner, "state", {}).values() if isinstance(s.get("step"), torch.Tensor)]


class _FunctionLevel(TorchFunctionMode):
    """Tensor methods that read device values on the host, and where new tensors live (simulated device)."""

    def __init__(self, counter: DispatchCounter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if func in _BACKWARD and hasattr(torch._C, "_set_skip_next_torch_function"):
            with self:  # the hooks autograd runs inside see this mode too
                torch._C._set_skip_next_torch_function(True)  # not this call itself again: its body
                return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = _tensors((args, kwargs))
        first = tensors[0] if tensors else None
        reads = first is not None and c.on_device(first)
        if name in _SCALAR_READS or name == "tolist" or name in _HOST_COPIES:
            if reads:
                c.sync("scalar" if name in _SCALAR_READS else "tolist" if name == "tolist" else "to_host")
            c._reading += 1
            try:
                out = func(*args, **kwargs)
            finally:
                c._reading -= 1
            out = c._host_alias(out, first)
            c._mark_host(out)
            return out
        if name == "to" and first is not None:
            device, non_blocking = _target(args, kwargs)
            out = func(*args, **kwargs)
            if device is None:  # a dtype change: stays where it was
                if not reads:
                    c._mark_host(out)
            elif c._names_host(device):
                if reads and not non_blocking:
                    c.sync("to_host")
                out = c._host_alias(out, first)
                c._mark_host(out)
            elif not reads:
                if not non_blocking:
                    c.sync("to_device")
                c._host.pop(out, None)  # on a CPU the upload may return the tensor itself: now a device tensor
            return out
        if not tensors:  # a factory: on the host unless told a device; from host data, a blocking upload
            host = c._names_host(kwargs.get("device"))
            if not host and name in ("tensor", "as_tensor") and args and not isinstance(args[0], torch.Tensor):
                c.sync("to_device")
        else:
            host = not any(c.on_device(t) for t in tensors)
        if not host:
            return func(*args, **kwargs)
        c._host_call += 1  # the operators inside run on the host: not device operators
        try:
            out = func(*args, **kwargs)
        finally:
            c._host_call -= 1
        c._mark_host(out)
        return out


class _DispatchLevel(TorchDispatchMode):
    """Every operator: counted, timed; collectives with their bytes; operators whose shape depends on data."""

    def __init__(self, counter: DispatchCounter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if any(t not in _PLAIN for t in types):
            if any(issubclass(t, FakeTensor) for t in types):  # shape propagation (DTensor's): no work, not counted
                return func(*args, **kwargs)
            return NotImplemented  # a tensor subclass (DTensor): it runs its local ops, counted here
        if c._quiet or not c.counting:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        c.counts.op_s += time.perf_counter() - t0
        counts = c.counts
        counts.ops += 1
        schema = func._schema.name
        counts.by_op[schema] += 1
        inputs = _tensors((args, kwargs))
        device = not c._host_call and (any(c.on_device(t) for t in inputs) if inputs else True)
        if device:
            counts.device_ops += 1
            if not func.is_view:
                counts.kernels += 1
        if schema.split("::")[0] in _COLLECTIVE_NAMESPACES:
            if "wait" not in schema:
                counts.collectives[schema] += 1
                groups = [a for a in args if isinstance(a, (torch.Tensor, list, tuple))]
                counts.collective_bytes += max((sum(t.numel() * t.element_size() for t in _tensors(g))
                                                for g in groups), default=0)
            return out
        if device and not c._reading:
            if schema == "aten::_local_scalar_dense":
                c.sync("scalar")
            elif schema in _DATA_DEPENDENT or (schema == "aten::repeat_interleave" and func._overloadname == "Tensor"
                                               and kwargs.get("output_size") is None) or (
                    schema in _BOOL_INDEXED and any(t.dtype in (torch.bool, torch.uint8)
                                                    for t in _tensors(args[1] if len(args) > 1 else ()))):
                c.sync("data_dependent")
        return out
