"""Deferred weight gradients for zero-bubble pipeline schedules, applied from outside the model.

Qi, Wan, Huang, Lin 2024, "Zero Bubble Pipeline Parallelism" (ICLR), §2: the backward of a linear
layer ``y = x W^T + b`` is two independent computations -- ``B``, the gradient of the input
``dx = dy W`` that the previous stage waits for, and ``W``, the weight gradients ``dW = dy^T x`` and
``db = sum(dy)`` that only the optimizer needs. :func:`defer_linear_weight_grads` replaces the
``forward`` of every ``nn.Linear`` in a module -- and the local matmul (``local_linear``) of the
tensor-parallel column / row layers (:mod:`shardwise.parallel.tensor.layers`; the vocabulary-parallel head
is a column layer) -- on the instance, like :mod:`shardwise.parallel.recompute`, so names and state dicts
are unchanged, by :class:`_DeferrableLinear`, whose backward returns ``dx`` at once and, while a
:class:`WeightGradStore` is deferring, queues ``(x, dy)`` under the current micro-batch instead of
computing ``dW``/``db``; :meth:`WeightGradStore.run` later computes and accumulates them into ``.grad``
(the schedule's ``W`` action). Other parameters (norms, embeddings, a row layer's bias added after its
reduction) get their gradients in ``B``. A deferred gradient passes through the hooks registered on its
parameter (``Tensor.register_hook``, e.g. the tensor-parallel sum over replicated key/value heads) before
it is accumulated, as autograd would pass it; such a hook's collective then runs in ``W``, at the same
point of the schedule on every rank of the tensor-parallel group.

The matmuls use the dtype autograd would: under ``torch.autocast`` the forward casts ``x`` and the
weight exactly as ``F.linear`` does and saves the cast copies, so ``dW`` is computed in that dtype and
accumulated into the fp32 ``.grad``. Saving goes through ``ctx.save_for_backward``, so activation
checkpointing (non-reentrant ``torch.utils.checkpoint``) recomputes the saved input as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """Per-micro-batch queues of deferred weight-gradient computations, owned by one pipeline rank.

    Outside :meth:`deferring`, deferrable layers compute their weight gradients in backward as usual."""

    def __init__(self):
        self._key: Hashable | None = None
        self._queues: dict[Hashable, list[Callable[[], None]]] = {}

    @property
    def active(self) -> bool:
        """Whether a backward is running whose weight gradients are to be deferred."""
        return self._key is not None

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Queue the weight gradients of the backward run inside under ``key`` (e.g. ``(chunk, mb)``)."""
        self._key = key
        self._queues.setdefault(key, [])
        try:
            yield
        finally:
            self._key = None

    def put(self, compute: Callable[[], None]) -> None:
        """Queue ``compute`` (which accumulates some weight gradients) under the current key."""
        if self._key is None:
            raise RuntimeError("WeightGradStore.put outside WeightGradStore.deferring")
        self._queues[self._key].append(compute)

    def run(self, key: Hashable) -> int:
        """Compute and accumulate every weight gradient queued under ``key``; returns how many."""
        queue = self._queues.pop(key, [])
        for compute in queue:
            compute()
        return len(queue)

    def clear(self) -> None:
        """Drop every queued computation (a new step starts; an interrupted one left some behind)."""
        self._key = None
        self._queues.clear()

    def pending(self) -> int:
        """Queued computations not yet run (0 after a complete step)."""
        return sum(len(q) for q in self._queues.values())


@torch.no_grad()
def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd's AccumulateGrad would, outside autograd: through the
    parameter's ``register_hook`` hooks first (autograd keeps a leaf's in ``_backward_hooks``: e.g. tensor
    parallelism's sum over replicated key/value heads; ZeRO's hook, which already ran in ``B`` with no
    gradient and made ``.grad`` a view of its flat buffer, is idempotent), then the first write stores it.
    Outside autograd because that view was made without gradients."""
    for hook in (getattr(param, "_backward_hooks", None) or {}).values():
        out = hook(grad)
        grad = grad if out is None else out
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _weight_grads(x: torch.Tensor, grad_out: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
    """``W`` of one linear layer (Qi et al. 2024 §2): ``dW = dy^T x``, ``db = sum dy`` over batch and time."""
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    _accumulate(weight, dy.t().mm(x.reshape(-1, x.shape[-1])))
    if bias is not None:
        _accumulate(bias, dy.sum(0))


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradients go to a :class:`WeightGradStore` while it is deferring."""

    @staticmethod
    def forward(ctx, x, weight, bias, store: WeightGradStore):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        xc, wc = (x, weight) if dtype is None else (x.to(dtype), weight.to(dtype))
        bc = bias if dtype is None or bias is None else bias.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.x_dtype, ctx.params, ctx.store = x.dtype, (weight, bias), store
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        grad_in = grad_out.matmul(w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if ctx.store.active:
            ctx.store.put(functools.partial(_weight_grads, x, grad_out, weight, bias))
            return grad_in, None, None, None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = dy.t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype)
        grad_b = None if bias is None else dy.sum(0).to(bias.dtype)
        return grad_in, grad_w, grad_b, None


def defer_linear_weight_grads(module: nn.Module, store: WeightGradStore) -> int:
    """Make every ``nn.Linear`` in ``module``, and every layer with a ``local_linear`` matmul (the
    tensor-parallel column / row layers), defer its weight gradients to ``store``; returns how many.

    Idempotent per layer. Without gradients (evaluation) the layer runs its plain ``F.linear``."""
    count = 0
    for layer in module.modules():
        if getattr(layer, "_weight_grad_store", None):
            continue
        if isinstance(layer, nn.Linear):
            layer.forward = _deferrable_forward(layer, store)
        elif hasattr(layer, "local_linear"):
            layer.local_linear = functools.partial(_deferrable_linear, store=store)
        else:
            continue
        layer._weight_grad_store = store
        count += 1
    return count


def _deferrable_linear(x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None,
                       store: WeightGradStore) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradients ``store`` may defer (a ``local_linear``)."""
    if not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, store)


def _deferrable_forward(layer: nn.Linear, store: WeightGradStore):
    plain = layer.forward

    @functools.wraps(plain)
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not layer.weight.requires_grad:
            return plain(x)
        return _DeferrableLinear.apply(x, layer.weight, layer.bias, store)

    return forward
