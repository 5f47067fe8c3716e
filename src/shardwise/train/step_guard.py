"""Whether an optimizer step is applied: decided once per step, on the device, identically on every rank.

A step is **skipped** when

* the loss of some rank is not finite,
* some gradient is not finite (with fp16: an overflow the loss scaler found while unscaling,
  Micikevicius et al. 2018, "Mixed Precision Training", §3.2 -- the same rule, not a second one), or
* the pre-clip global gradient norm exceeds ``train.skip_grad_norm_above`` (a spike guard; 0: off).

torchtitan checks the loss and the gradient norm for finiteness across the whole world before its optimizer
and scheduler step, so that no rank updates its state before the others know (pytorch/torchtitan#4226);
Megatron-LM skips an update on overflow and leaves its scheduler where it was.

**Agreement.** The verdict joins the reduction the step already has for its loss (the mean over dp x cp): one
all-reduce (sum, float64) over the whole world of ``[this rank's loss where it counts, 0 x the gradient norm +
the overflow flag, norm > threshold]``. Where a rank's loss does not count (a second tensor-parallel rank or
pipeline stage holds the same loss) it enters as ``0 x loss``, which is NaN when the loss is: a non-finite
value on any rank makes the sum non-finite on every rank, so every rank decides the same from the same
numbers, whichever rank the NaN came from and whether its gradient reductions would have spread it.

**Applying it** never reads the verdict on the host: the optimizer takes the flag as ``found_inf`` (torch's
fused AdamW leaves every weight, moment and step count as it was where it is set; the protocol
``torch.amp.GradScaler`` drives it with; :class:`~shardwise.parallel.zero.ZeroOptimizer` passes it to its master
pieces); the learning-rate schedule indexes the applied steps with a device-side count of skipped ones
(:class:`~shardwise.train.optim.DeviceLrSchedule`); the fp16 loss scale backs off from the same flag on every
rank; the routers' balancing biases move by ``applied x`` their step. The host learns of a skip one step later
(:mod:`shardwise.train.readout`): it counts it, names it in one line, and stops the run after
``train.max_skipped_steps`` consecutive skips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.dist.devices import exchange_device
from shardwise.train.precision import DynamicLossScaler


class SkippedStepsError(RuntimeError):
    """``train.max_skipped_steps`` consecutive steps were skipped: the run stops."""


@dataclass
class StepVerdict:
    """One step's loss and verdict, 0-dim tensors on the device, equal on every rank (but ``grad_norm``)."""

    loss: torch.Tensor
    """float64: the step's loss, the mean over dp x cp (not finite when some rank's loss is not)."""
    grad_norm: torch.Tensor
    """fp32: the pre-clip global gradient norm as this rank measured it."""
    nonfinite: torch.Tensor
    """fp32, 0 or 1: a loss or a gradient is not finite somewhere (an fp16 overflow included)."""
    spike: torch.Tensor
    """fp32, 0 or 1: the norm exceeded ``train.skip_grad_norm_above`` on some rank."""
    skip: torch.Tensor
    """fp32, 0 or 1: the step is not applied (``nonfinite`` or ``spike``)."""


def agree(replica_loss: torch.Tensor, grad_norm: torch.Tensor, found_inf: torch.Tensor | None, *,
          loss_counts: bool, loss_ranks: int, skip_above: float = 0.0) -> StepVerdict:
    """The verdict of a step (a collective over the whole world: every rank calls it once per step).

    ``replica_loss``: this rank's loss of the step; it is summed where ``loss_counts`` (one rank per dp x cp
    replica) and the sum divided by ``loss_ranks``. ``grad_norm``: the pre-clip norm; ``found_inf``: the fp16
    loss scaler's flag of this rank (None without one)."""
    flags = grad_norm.double() * 0.0  # NaN where the norm is not finite
    if found_inf is not None:
        flags = flags + found_inf.to(flags.device, torch.float64)
    over = (grad_norm > skip_above).double() if skip_above > 0 else torch.zeros_like(flags)
    loss = replica_loss.detach().to(flags.device, torch.float64) * (1.0 if loss_counts else 0.0)
    votes = torch.stack([loss, flags, over])
    if dist.get_world_size() > 1:
        dist.all_reduce(votes)
    nonfinite = (~torch.isfinite(votes[:2]).all() | (votes[1] > 0)).float()
    spike = (votes[2] > 0).float()
    return StepVerdict(loss=votes[0] / loss_ranks, grad_norm=grad_norm, nonfinite=nonfinite, spike=spike,
                       skip=torch.maximum(nonfinite, spike))


def step_optimizer(optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()`` where ``skip`` (a 0-dim flag on the device) is 0; nothing changes where it is 1.
    ``optimizer``: a fused torch optimizer (it takes ``found_inf``) or a ZeRO optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer.step(found_inf=skip)  # ZeroOptimizer: hands the flag to its master pieces' optimizer
        return
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise TypeError(f"{type(optimizer).__name__} cannot skip a step on the device; build it with fused=True")
    optimizer.found_inf = skip
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


class StepGuard:
    """Applies each step's verdict on the device, and counts the skips on the host one step later.

    ``skipped`` (a device tensor) counts the skipped steps so far: the learning-rate schedule's index is the
    step minus it. ``total`` and ``streak`` are the same count and the current run of consecutive skips,
    known on the host once a step's verdict has been read (:meth:`note`)."""

    def __init__(self, max_skipped: int, device: torch.device, skipped: int = 0):
        self.max_skipped = max_skipped
        self.skipped = torch.full((), float(skipped), dtype=torch.float32, device=device)
        self.total, self.streak = skipped, 0
        self.last_applied: int | None = None
        """The newest step known to have been applied (None: none yet in this process)."""

    def apply(self, optimizer, verdict: StepVerdict, scaler: DynamicLossScaler | None) -> None:
        """Step ``optimizer`` unless the verdict says skip; back off or grow the fp16 scale on its flag."""
        step_optimizer(optimizer, verdict.skip)
        if scaler is not None:
            scaler.update(verdict.nonfinite)
        self.skipped.add_(verdict.skip)

    def note(self, step: int, skipped: bool) -> None:
        """The host has read step ``step``'s verdict (one step late): count it."""
        if not skipped:
            self.streak, self.last_applied = 0, step
            return
        self.total += 1
        self.streak += 1

    @property
    def exhausted(self) -> bool:
        """``train.max_skipped_steps`` consecutive skips (0: never)."""
        return 0 < self.max_skipped <= self.streak

    def state_dict(self) -> dict:
        return {"skipped_steps": self.total}


def skip_reasons(values: dict[str, float], skip_above: float) -> str:
    """Why a step was skipped, from its read-back values (``loss``, ``grad_norm``, ``nonfinite``, ``spike``,
    and ``loss_scale`` with fp16)."""
    loss, norm = values["loss"], values["grad_norm"]
    reasons = []
    if values["nonfinite"]:
        if not math.isfinite(loss):
            reasons.append(f"loss {loss}")
        if not math.isfinite(norm):
            fp16 = " (fp16 overflow: the loss scale backs off)" if "loss_scale" in values else ""
            reasons.append(f"gradient norm {norm}{fp16}")
        if math.isfinite(loss) and math.isfinite(norm):
            reasons.append("a non-finite gradient on another rank")
    if values["spike"]:
        reasons.append(f"gradient norm {norm:.4g} above train.skip_grad_norm_above={skip_above:g}")
    return "; ".join(reasons)


def nonfinite_sources(replica_loss: torch.Tensor, micro_losses: torch.Tensor | None) -> list[tuple[int, int]]:
    """Which ranks' losses were not finite in a skipped step, and the first such micro-batch of each (-1:
    unknown): ``[(rank, micro-batch)]``. A collective over the whole world, run only after a skip, when the
    host reads it (it waits for the device: no longer the steady state)."""
    bad_micro = -1.0
    if micro_losses is not None and micro_losses.numel():
        bad = ~torch.isfinite(micro_losses.detach())
        bad_micro = float(bad.float().argmax()) if bool(bad.any()) else -1.0
    mine = torch.tensor([0.0 if bool(torch.isfinite(replica_loss.detach())) else 1.0, bad_micro],
                        dtype=torch.float64, device=exchange_device())  # a host-side exchange (gloo beside nccl)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [(rank, int(t[1])) for rank, t in enumerate(every) if t[0] > 0]


def skip_line(step: int, values: dict[str, float], sources: list[tuple[int, int]], guard: StepGuard,
              skip_above: float) -> str:
    """The one log line of a skipped step: which step, why, from which rank and micro-batch where known."""
    where = ", ".join(f"rank {r}" + (f" micro-batch {m}" if m >= 0 else "") for r, m in sources)
    origin = f" (non-finite loss on {where})" if where else ""
    limit = f" of at most train.max_skipped_steps={guard.max_skipped}" if guard.max_skipped else ""
    return (f"step {step} skipped on every rank: {skip_reasons(values, skip_above)}{origin}; weights, optimizer "
            f"state and learning-rate schedule unchanged ({guard.streak} consecutive{limit}, {guard.total} in all)")
