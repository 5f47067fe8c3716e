"""How one step's micro-batches pass through this rank's model part: the engine's schedule.

The engine (:mod:`shardwise.train.engine`) holds one schedule and asks it for a step; both kinds end with
the data-parallel wrapper's gradients averaged over its group:

* :class:`OneStage` (``parallel.pp = 1``): each micro-batch's forward and backward in turn, gradients
  accumulating locally (``no_sync``) until the last backward, during which the wrapper reduces them
  bucket by bucket as they become ready (overlap, Li et al. 2020 §3.2.3);
* :class:`PipelineSchedule` (``parallel.pp > 1``): the pipeline schedule (GPipe, 1F1B, interleaved,
  ZB-H1; :class:`~shardwise.parallel.pipeline.Pipeline`) runs every micro-batch's forward and backward
  with gradients accumulating, then the wrapper reduces them once, after the flush (Narayanan et al.
  2021 §3) -- ZeRO-1/2 start with each chunk's units during its last backward where the schedule allows
  (``ZeroDataParallel.final_backward``). Under ZeRO-2/3 the gradients accumulate unsharded and ZeRO-3 keeps a
  stage's parameters gathered from its first forward to the flush (``ZeroDataParallel.pipeline_step``). The last stage's
  loss, plus the auxiliary router losses of earlier stages' mixture-of-experts blocks, is summed along the
  pipeline; each step's timelines are gathered for the measured bubble (§2.2) and ``timeline.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.model.dropout import DropoutKey
from shardwise.parallel.pipeline import (
    Pipeline,
    Timeline,
    bubble_fraction,
    gather_timelines,
    replayed_bubble,
    theoretical_bubble,
    zb_h1_bubble,
)
from shardwise.train.precision import DynamicLossScaler, autocast_context

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class OneStage:
    """The whole model part on this rank: ``wrapper(x, y)`` returns the loss of a micro-batch."""

    def __init__(self, wrapper, precision: str, device: torch.device):
        self.wrapper, self.precision, self.device = wrapper, precision, device

    def run(self, batches: Batches, scaler: DynamicLossScaler | None,
            dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch (loss / m each, so the gradients are those of the mean);
        the mean loss of this replica's micro-batches. ``dropout_key``: that of the first micro-batch, shifted
        by the sequences before each."""
        losses = []
        done = 0
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with self.wrapper.no_sync() if not last else contextlib.nullcontext():
                with autocast_context(self.precision, self.device.type):
                    if dropout_key is None:
                        loss = self.wrapper(x, y)
                    else:
                        loss = self.wrapper(x, y, dropout_key=dropout_key.shifted(done))
                losses.append(loss.detach())
                scaled = loss / len(batches) if len(batches) > 1 else loss  # (no operator to divide by one)
                (scaler.scale_loss(scaled) if scaler else scaled).backward()
            done += x.shape[0]
        self.micro_losses = torch.stack(losses) if len(losses) > 1 else losses[0].reshape(1)
        """Each micro-batch's loss of the last step (read only after a skipped step, to name where it came from)."""
        loss_sum = losses[0]
        for loss in losses[1:]:  # in order, as the micro-batches ran: the same sum on every layout
            loss_sum = loss_sum + loss
        return (loss_sum / len(losses) if len(losses) > 1 else loss_sum).float()  # (fp32 already: no operator)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.precision, self.device.type):
            return self.wrapper(x, y).double()

    def step_metrics(self, timeline: bool = False) -> dict[str, float]:
        return {}

    def write_timeline(self, run_dir: Path, step: int) -> None:
        """Nothing to keep: one stage has no pipeline timeline."""


class PipelineSchedule:
    """This rank's pipeline stages (``pipe``) under a data-parallel wrapper that reduces after the flush."""

    def __init__(self, pipe: Pipeline, wrapper, pp_group: dist.ProcessGroup, stage_ranks: list[int],
                 schedule: str, device: torch.device):
        self.pipe, self.wrapper, self.pp_group, self.stage_ranks = pipe, wrapper, pp_group, stage_ranks
        self.schedule, self.device = schedule, device
        self.timelines: list[Timeline] = []

    def run(self, batches: Batches, scaler: DynamicLossScaler | None,
            dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """One step of the schedule over the concatenated micro-batches, then the data-parallel average."""
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        self.pipe.loss_scale = scaler.scale_tensor if scaler else None
        with self.wrapper.pipeline_step():  # gradients accumulate over the schedule ...
            loss = self.pipe.step(x, y, dropout_key, final_backward=getattr(self.wrapper, "final_backward", None))
        self.wrapper.reduce_gradients()  # ... and are averaged once, after the flush
        self.timelines = []  # gathered by :meth:`step_metrics` on the steps that report them
        # the single-process loss: the last stage's (with its blocks' auxiliary losses) and earlier stages' aux
        out = torch.zeros((), dtype=torch.float64, device=self.device) if loss is None else loss.double()
        out = out + self.pipe.aux_loss.to(self.device)
        dist.all_reduce(out, group=self.pp_group)
        return out

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._from_last_stage(self.pipe.forward_only(x, y))

    def _from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        out = torch.zeros((), dtype=torch.float64, device=self.device) if loss is None else loss.double()
        dist.broadcast(out, src=self.stage_ranks[-1], group=self.pp_group)
        return out

    def bubble_theory(self) -> float:
        """The schedule's idle fraction with equal stages: (p - 1) / (v m + p - 1) for GPipe / 1F1B /
        interleaved; ZB-H1's with T_F = T_B = T_W (Qi et al. 2024 §3.1)."""
        p, m, v = self.pipe.p, self.pipe.m, len(self.pipe.chunks)
        return zb_h1_bubble(p, m) if self.schedule == "zb-h1" else theoretical_bubble(p, m, v)

    def step_metrics(self, timeline: bool = False) -> dict[str, float]:
        """The theoretical bubble; with ``timeline`` (the steps that report it) also the measured bubble of the last
        step, the schedule's replayed with the step's compute times and free communication (between the two: what
        the stages' unequal work adds to the theory, and what executing the schedule adds to that), and every stage
        rank's peak live activations. Those gather every stage's timeline -- an object collective that waits for
        the device, as does reading its clock -- so not every step does."""
        if not timeline:
            return {"bubble_theory": self.bubble_theory()}
        self.timelines = gather_timelines(self.pipe.timeline, self.pp_group)
        out = {"bubble": bubble_fraction(self.timelines), "bubble_theory": self.bubble_theory(),
               "bubble_replayed": replayed_bubble(self.timelines, self.pipe.all_actions)[0]}
        out.update({f"pp_peak_live_{t.rank}": float(t.peak_live) for t in self.timelines})
        return out

    def write_timeline(self, run_dir: Path, step: int) -> None:
        """Keep the last step's timelines as ``timeline.json`` (rank 0 of the world writes)."""
        if dist.get_rank() != 0 or not self.timelines:
            return
        doc = {"step": step, "schedule": self.schedule, "pp": self.pipe.p, "microbatches": self.pipe.m,
               "virtual": len(self.pipe.chunks), "bubble": bubble_fraction(self.timelines),
               "bubble_theory": self.bubble_theory(),
               "bubble_replayed": replayed_bubble(self.timelines, self.pipe.all_actions)[0],
               "timelines": [dataclasses.asdict(t) for t in self.timelines]}
        tmp = Path(run_dir) / "timeline.json.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(Path(run_dir) / "timeline.json")
