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
_FP32_MAX = torch.finfo(torch.float32).max


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
    """Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", §3.2).

    Usage per optimizer step::

        scaler.scale_loss(loss).backward()
        found_inf = scaler.unscale_(model.parameters(), group=dp_group)
        if not found_inf:
            optimizer.step()
        scaler.update(found_inf)

    On overflow the scale is multiplied by ``backoff_factor`` (never below ``min_scale``), the
    growth counter is reset and ``skipped_steps`` increases. After ``growth_interval``
    consecutive clean steps the scale is multiplied by ``growth_factor`` (if the result stays
    finite in fp32). This matches ``torch.amp.GradScaler`` except for the ``min_scale`` floor.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
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
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self._growth_tracker = 0
        self._skipped_steps = 0

    @property
    def scale(self) -> float:
        """The current loss scale S."""
        return self._scale

    @property
    def skipped_steps(self) -> int:
        """How many steps have been skipped because of overflowing gradients."""
        return self._skipped_steps

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; call ``.backward()`` on the result."""
        return loss * self._scale

    def unscale_(self, params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """Divide every existing ``.grad`` by S in place; return True if any grad is inf/NaN.

        Uses the fused ``torch._amp_foreach_non_finite_check_and_unscale_`` kernel (the one
        ``GradScaler`` uses) per (device, dtype) group: it multiplies by the fp32 reciprocal of S,
        which equals division exactly while S is a power of two (always, with the default
        factors). With ``group`` given, the overflow flag is all-reduced with MAX so every rank
        makes the same skip decision.
        """
        grads = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                p.grad = g = g.coalesce()
                g = g._values()
            grads.append(g)
        return self.unscale_grads_(grads, group)

    def unscale_grads_(self, grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """:meth:`unscale_` on the gradient tensors themselves (e.g. a ZeRO rank's slices)."""
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            buckets.setdefault((g.device, g.dtype), []).append(g)

        flag_device = next(iter(buckets))[0] if buckets else self._flag_device(group)
        found = torch.zeros((), dtype=torch.float32, device=flag_device)
        for (device, _), grads in buckets.items():
            found_here = torch.zeros((), dtype=torch.float32, device=device)
            inv_scale = torch.full((), 1.0 / self._scale, dtype=torch.float64, device=device).float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_scale)
            found += found_here.to(flag_device)
        if group is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    @staticmethod
    def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
        if group is None or not torch.cuda.is_available():
            return torch.device("cpu")
        try:
            backend = dist.get_backend(group)
        except (ValueError, RuntimeError):  # a group constructed directly, not registered with c10d
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def update(self, found_inf: bool) -> None:
        """Adjust S after a step: back off on overflow, grow after ``growth_interval`` clean steps."""
        if found_inf:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._growth_tracker = 0
            self._skipped_steps += 1
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            grown = self._scale * self.growth_factor
            if grown <= _FP32_MAX:
                self._scale = grown
            self._growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state (floats and ints)."""
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "growth_tracker": self._growth_tracker,
            "skipped_steps": self._skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; raises ValueError naming any missing or bad field."""
        required = {
            "scale": float,
            "growth_factor": float,
            "backoff_factor": float,
            "growth_interval": int,
            "min_scale": float,
            "growth_tracker": int,
            "skipped_steps": int,
        }
        for key, kind in required.items():
            if key not in state:
                raise ValueError(f"loss scaler state lacks {key!r}")
            value = state[key]
            ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
            if isinstance(value, bool) or not ok:
                raise ValueError(f"loss scaler state {key}={value!r} is not a{'n int' if kind is int else ' number'}")
        hyper = ("scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale")
        fresh = DynamicLossScaler(*(state[k] for k in hyper))  # re-validates the hyper-parameters
        if state["growth_tracker"] < 0 or state["skipped_steps"] < 0:
            raise ValueError("loss scaler state has negative counters")
        self.__dict__.update(fresh.__dict__)
        self._growth_tracker = state["growth_tracker"]
        self._skipped_steps = state["skipped_steps"]
