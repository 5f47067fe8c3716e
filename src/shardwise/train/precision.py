"""Mixed precision: autocast contexts and dynamic loss scaling.

``bf16`` needs no loss scaling (its exponent range equals fp32's); ``fp16`` does, because small
gradients underflow its 5-bit exponent. :class:`DynamicLossScaler` implements the dynamic loss
scaling of Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2: multiply the loss by
a large scale S before backward, divide the gradients by S before the optimizer step, skip the
step and shrink S when any gradient overflowed, and grow S after a run of clean steps.
``torch.amp.GradScaler`` implements the same rule and serves as the reference in the tests.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PRECISIONS", "autocast_context", "needs_loss_scaling", "DynamicLossScaler"]

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not supported; use one of {', '.join(PRECISIONS)}")


def autocast_context(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """Context manager running the forward pass in ``precision`` on ``device_type``.

    ``"bf16"``/``"fp16"`` give ``torch.autocast(device_type, dtype=bfloat16/float16)``: matmuls
    and convolutions run in the low-precision dtype, reductions and losses stay in fp32
    (PyTorch's autocast op lists). ``"fp32"`` gives a no-op context. Both low-precision modes
    work on CPU in torch >= 2.4 (fp16 CPU autocast is correct but usually slower than bf16).
    """
    _check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=_AUTOCAST_DTYPES[precision])


def needs_loss_scaling(precision: str) -> bool:
    """True for ``fp16``, whose narrow exponent range needs a :class:`DynamicLossScaler`."""
    _check_precision(precision)
    return precision == "fp16"


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", §3.2), kept on the device.

    Usage per optimizer step (the trainer's :mod:`shardwise.train.step_guard` does this with the flag of every
    rank, and skips the step on the device)::

        scaler.scale_loss(loss).backward()
        found_inf = scaler.unscale_(model.parameters(), group=dp_group)
        if not found_inf:
            optimizer.step()
        scaler.update(found_inf)

    On overflow the scale is multiplied by ``backoff_factor`` (never below ``min_scale``) and the growth counter
    is reset. After ``growth_interval`` consecutive clean steps the scale is multiplied by ``growth_factor`` (if
    the result stays finite in fp32). This matches ``torch.amp.GradScaler`` except for the ``min_scale`` floor.
    The scale and the counter are tensors on ``device`` and :meth:`update` runs there (GradScaler's
    ``_amp_update_scale_`` kernel), so a step never waits for the host to read the overflow flag; the skipped
    steps are counted by whoever decides the skip (the trainer's step guard).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if not 0.0 < min_scale <= init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale={init_scale}], got {min_scale!r}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def scale(self) -> float:
        """The current loss scale S, read on the host (waits for the device)."""
        return float(self._scale)

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current loss scale S as a 0-dim fp32 tensor on the device (reading it does not wait)."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; call ``.backward()`` on the result."""
        return loss * self._scale

    def unscale_(self, params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """Divide every existing ``.grad`` by S in place; return True if any grad is inf/NaN (read on the host).

        With ``group`` given, the overflow flag is all-reduced with MAX so every rank makes the same skip
        decision. See :meth:`unscale_grads_` for the flag kept on the device."""
        grads = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                p.grad = g = g.coalesce()
                g = g._values()
            grads.append(g)
        found = self.unscale_grads_(grads)
        if group is not None:
            found = found.to(self._flag_device(group))
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def unscale_grads_(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide the gradient tensors (e.g. a ZeRO rank's slices) by S in place; return this rank's overflow
        flag, a 0-dim fp32 tensor on the scale's device (1: some gradient is inf/NaN), without reading it.

        Uses the fused ``torch._amp_foreach_non_finite_check_and_unscale_`` kernel (the one ``GradScaler``
        uses) per (device, dtype) group: it multiplies by the fp32 reciprocal of S, which equals division
        exactly while S is a power of two (always, with the default factors)."""
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            buckets.setdefault((g.device, g.dtype), []).append(g)
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        inv_scale = self._scale.double().reciprocal().float()
        for (device, _), grads in buckets.items():
            found_here = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_scale.to(device))
            found += found_here.to(found.device)
        return found.clamp_(max=1.0)

    @staticmethod
    def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
        if group is None or not torch.cuda.is_available():
            return torch.device("cpu")
        try:
            backend = dist.get_backend(group)
        except (ValueError, RuntimeError):  # a group constructed directly, not registered with c10d
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """Adjust S after a step: back off on overflow, grow after ``growth_interval`` clean steps. ``found_inf``:
        a bool, or a flag tensor (nonzero: overflow), which is not read on the host."""
        found = torch.as_tensor(found_inf, dtype=torch.float32).to(self._scale.device).reshape(())
        torch._amp_update_scale_(self._scale, self._growth_tracker, found.clamp(max=1.0), self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self._scale.clamp_(min=self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state (floats and ints; read on the host)."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "growth_tracker": int(self._growth_tracker),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; raises ValueError naming any missing or bad field. (A
        ``skipped_steps`` count, which older checkpoints hold here, is the step guard's now and is ignored.)"""
        required = {
            "scale": float,
            "growth_factor": float,
            "backoff_factor": float,
            "growth_interval": int,
            "min_scale": float,
            "growth_tracker": int,
        }
        for key, kind in required.items():
            if key not in state:
                raise ValueError(f"loss scaler state lacks {key!r}")
            value = state[key]
            ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
            if isinstance(value, bool) or not ok:
                raise ValueError(f"loss scaler state {key}={value!r} is not a{'n int' if kind is int else ' number'}")
        hyper = ("scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale")
        fresh = DynamicLossScaler(*(state[k] for k in hyper), device=self._scale.device)  # re-validates them
        if state["growth_tracker"] < 0:
            raise ValueError("loss scaler state has a negative growth_tracker")
        self.__dict__.update(fresh.__dict__)
        self._growth_tracker.fill_(state["growth_tracker"])
