"""ZeRO inside a pipeline: what a step holds, and the one reduction after the flush.

A pipeline schedule runs every micro-batch's forward and backward inside :meth:`PipelineFlush.pipeline_step`,
then calls :meth:`PipelineFlush.reduce_gradients` after the flush. A rank may hold several chunks (``module`` an
``nn.ModuleList``): ZeRO-3 units never span two chunks, and the root unit -- the embedding side or the head,
absent on a middle stage -- is gathered as each chunk starts. The two choices (Rajbhandari et al. 2020 §5.2-5.3
leave them open for pipelines):

* gradients across micro-batches: **accumulated unsharded, reduce-scattered once after the flush** (stages 2
  and 3 straight into each unit's flat buffer). The alternative, a reduce-scatter after each micro-batch's
  backward of a stage (ZeRO §5.2's steady state), sends m times the gradient bytes, and with zb-h1 it would
  have to wait for the micro-batch's ``W`` passes; DeepSpeed refuses ZeRO-2/3 with pipelines for that reason.
* parameters (ZeRO-3): **kept gathered from a unit's first forward to the flush**. Re-gathering per
  micro-batch would gather up to 2m times a step instead of once (measured with the free left on: 2.5x the
  bytes of a pp 2 x dp 2, m = 4 step) to save the gathered stage -- no more than the unsharded gradients the
  step holds anyway.
* so a step holds its stage's full gradients and (ZeRO-3) parameters until the flush, and sends what ZeRO-1
  sends: one reduce-scatter and one all-gather of the stage per step. ZeRO-2/3 keep only the slices between
  steps (the accountant's ``grads``/``params``; what the flush held, :attr:`flush_bytes`, beside them).
  These are torchtitan's choices for FSDP in a pipeline (``reshard_after_forward`` off; gradient sync on a
  stage's last backward only), and torch.distributed.pipelining's (bench/bench_pp_fsdp.py).
* stages 1-2 need not wait for the flush, though: once a chunk's last backward has run, its gradients are
  final. The executor runs that backward inside :meth:`PipelineFlush.final_backward`, where each unit is
  reduce-scattered as soon as its gradients are complete, as in a one-stage step's last backward (Megatron-Core
  overlaps its data-parallel reduction with the pipeline's cool-down the same way). Where the schedule splits
  the backward (zb-h1: the weight gradients of ``W`` are accumulated outside autograd) and for the tied table
  (its two copies add their gradients after the flush) the reduction still waits for the flush.

A mixin of :class:`shardwise.parallel.zero.ZeroDataParallel`, with the reduction of :mod:`.reduce` and the
gather / free of :mod:`.stage3` (which keep units while ``_hold`` is set). The parameters' all-gather after the
optimizer step is waited for by the first micro-batch's forward of each chunk (:mod:`.gather`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class PipelineFlush:
    """A pipeline step's accumulation (:meth:`pipeline_step`) and its reduction after the flush."""

    @contextlib.contextmanager
    def pipeline_step(self) -> Iterator[None]:
        """A pipeline step's forward and backward passes (every micro-batch of every chunk, in the schedule's
        order), followed by :meth:`reduce_gradients` after the flush. Inside, gradients accumulate unsharded
        (stages 2 and 3 straight into each unit's flat buffer), nothing is communicated, and ZeRO-3 keeps each
        unit gathered from its first forward on: one gather and one reduce-scatter per unit and step."""
        previous = self._sync, self._hold
        self._sync, self._hold = False, True
        self._reset()
        self._held_at_first = None
        try:
            yield
        finally:
            self._sync, self._hold = previous

    @contextlib.contextmanager
    def final_backward(self) -> Iterator[None]:
        """Inside :meth:`pipeline_step`: the backward run inside is a chunk's last of the step, so the gradients
        it completes are final -- stages 1-2 with ``overlap_reduce`` reduce-scatter each unit as soon as all its
        gradients are in (in the fixed order, as :meth:`_reduce_ready`); otherwise nothing changes."""
        if self.stage == 3 or not self.overlap_reduce or not self._hold:
            yield
            return
        previous, self._final = self._final, True
        try:
            yield
        finally:
            self._final = previous

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce every unit's accumulated gradients now and hand the masters their slices: for a caller
        whose backward passes all ran under :meth:`pipeline_step` (or ``no_sync``) -- a pipeline schedule,
        whose micro-batches' backward passes interleave with other stages' work, so no single pass is "the
        last" (Narayanan et al. 2021 §3: the data-parallel reduction follows the pipeline flush). ZeRO-3's
        units, held gathered through the step, are freed first: the reduction needs only the gradients."""
        # what the step held before a chunk's last backward began releasing its units, else what the flush holds
        self.flush_bytes = self._held_bytes() if self._held_at_first is None else self._held_at_first
        self._held_at_first = None
        if self.stage == 3:
            for u in self.units:
                self._free(u)
        self._reduce_rest()  # what the chunks' last backward passes left (:meth:`final_backward`), then wait
        self._reset()

    def _held_bytes(self) -> dict[str, int]:
        """What a pipeline step holds at its flush beyond the sharded model state, from the storages:
        ZeRO-3's gathered units, and stages 2-3's unsharded gradients (flat buffers and any ``.grad`` of
        its own). Stage 1's full gradients are its model state (``grads``)."""
        if self.stage == 1:
            return {}
        grads = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in [u.grad_flat for u in self.units] + [p.grad for p in self._params] if t is not None}
        out = {"grad_accum": sum(grads.values())}
        if self.stage == 3:
            out["gathered"] = sum(u.full.untyped_storage().nbytes() for u in self.units if u.gathered)
        return out
