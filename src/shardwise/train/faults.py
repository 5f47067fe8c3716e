"""Injected faults, for tests only: ``run.fault`` names what goes wrong, where and when.

A failure test needs a worker to die at a chosen point, reproducibly, in a real launch (torchrun's
agent, real processes, real signals). ``run.fault`` is a comma-separated list of ``KIND@STEP:rRANK``;
the i-th entry fires in restart attempt i only (``TORCHELASTIC_RESTART_COUNT``, the elastic agent's
contract with its workers), so a restarted group does not fail the same way again and one launch can
exercise several failures in turn. Kinds:

* ``kill``  -- SIGKILL this rank right after optimizer step STEP is logged, before its checkpoint;
* ``stop``  -- SIGSTOP it there (a hung peer that does not even answer SIGTERM);
* ``hang``  -- sleep there forever (a hung peer that still dies on SIGTERM: faster to tear down);
* ``save``  -- SIGKILL it while checkpoint STEP is being written: after its own shard file is written
  and before the checkpoint is complete, leaving a partial temporary directory behind;
* ``raise`` -- raise a RuntimeError there (an error that happens again on every retry, like a bug or a
  NaN: listed for two attempts, it shows that the group stops restarting, :mod:`shardwise.train.recovery`);
* ``nan_loss`` -- this rank's loss of optimizer step STEP is NaN (its gradients are not touched): every rank
  must skip the step (:mod:`shardwise.train.step_guard`);
* ``nan_grad`` -- one element of this rank's gradient of step STEP (of a piece its gradient norm counts) is
  NaN, after the gradients were reduced (so under plain data parallelism the other replicas' gradients stay
  finite): every rank must skip the step.

Example: ``--run.fault kill@3:r1,save@6:r0``. Not for production runs; the empty default does nothing.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.config import ConfigError

if TYPE_CHECKING:  # the config checks import this module: no torch at import time
    import torch

FAILURES = ("kill", "stop", "hang", "save", "raise")
"""The kinds that end the attempt (what the failover soak draws)."""
KINDS = (*FAILURES, "nan_loss", "nan_grad")
_ITEM = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+):r(?P<rank>\d+)$")


@dataclass(frozen=True)
class Fault:
    """One injected failure: ``kind`` at optimizer step ``step`` on global rank ``rank``."""

    kind: str
    step: int
    rank: int


def parse_faults(text: str, world: int | None = None, steps: int | None = None) -> list[Fault]:
    """The entries of ``run.fault`` (one per restart attempt), or ConfigError naming what is wrong."""
    if not text.strip():
        return []
    faults = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if not m or m["kind"] not in KINDS:
            raise ConfigError(f"run.fault={text!r}: {item.strip()!r} is not KIND@STEP:rRANK with KIND one of "
                              f"{', '.join(KINDS)} (e.g. 'kill@3:r1'); it is for failover tests only")
        fault = Fault(m["kind"], int(m["step"]), int(m["rank"]))
        if world is not None and fault.rank >= world:
            raise ConfigError(f"run.fault={text!r}: rank {fault.rank} does not exist in a world of {world}; "
                              f"use r0..r{world - 1}")
        if steps is not None and not 1 <= fault.step <= steps:
            raise ConfigError(f"run.fault={text!r}: step {fault.step} is not among the run's steps 1..{steps}")
        faults.append(fault)
    return faults


def restart_attempt() -> int:
    """Which attempt of the group this is: 0 first, then 1, 2, ... after each restart by the agent."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class FaultPlan:
    """The fault (if any) this rank injects in this attempt; every method is a no-op otherwise."""

    def __init__(self, text: str, rank: int, attempt: int | None = None):
        faults = parse_faults(text)
        attempt = restart_attempt() if attempt is None else attempt
        fault = faults[attempt] if attempt < len(faults) else None
        self.fault = fault if fault is not None and fault.rank == rank else None
        self.attempt_fault = fault
        """This attempt's fault, on whichever rank it fires."""

    def after_step(self, step: int) -> None:
        """Called once optimizer step ``step`` is done and logged (before its checkpoint)."""
        f = self.fault
        if f is not None and f.kind == "raise" and f.step == step:
            raise RuntimeError(f"injected error after step {step} on rank {f.rank}")
        if f is not None and f.kind in ("kill", "stop", "hang") and f.step == step:
            _fire(f.kind)

    def fires_after(self, step: int) -> bool:
        """Whether :meth:`after_step` ends this attempt at ``step`` on some rank (so every rank, rank 0 among them,
        logs the step first, as the loop otherwise does one step late)."""
        f = self.attempt_fault
        return f is not None and f.kind in ("kill", "stop", "hang", "raise") and f.step == step

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (this rank's loss of optimizer step ``step``), NaN where ``nan_loss`` says so."""
        f = self.fault
        if f is not None and f.kind == "nan_loss" and f.step == step:
            return loss + float("nan")
        return loss

    def poison_gradient(self, step: int, grad_pieces: Callable[[], list[tuple[torch.Tensor, object]]]) -> None:
        """Set one element of this rank's first gradient piece (of ``grad_pieces()``: ``(gradient, parameter)``
        pairs) to NaN where ``nan_grad`` says so."""
        f = self.fault
        if f is not None and f.kind == "nan_grad" and f.step == step and (pieces := grad_pieces()):
            pieces[0][0].view(-1)[0] = float("nan")

    def during_save(self, step: int) -> Callable[[], None] | None:
        """The callback checkpoint ``step``'s writer runs after writing its own file, or None."""
        f = self.fault
        if f is not None and f.kind == "save" and f.step == step:
            return lambda: _fire("kill")
        return None


def _fire(kind: str) -> None:
    if kind == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)


def resumed_after(fault: Fault, resumed: int, every: int) -> int:
    """The step the attempt after ``fault`` resumes from, when the failed attempt resumed from ``resumed`` and
    checkpoints are written every ``every`` steps: the newest checkpoint completed before the fault (``kill``,
    ``stop``, ``hang`` and ``raise`` fire after step STEP is logged and before its checkpoint; ``save`` while
    checkpoint STEP is written, so neither is complete)."""
    return max(resumed, (fault.step - 1) // every * every)


def draw_faults(rng, n: int, steps: int, every: int, world: int, kinds: tuple[str, ...] = FAILURES) -> list[Fault]:
    """``n`` faults at random (``rng``: a ``random.Random``), one per attempt, each on a random rank and at a
    random step that its attempt reaches (after the step the previous fault's attempt resumed from; ``save``
    at a step that writes a checkpoint). Two faults in a row on the same rank that leave an error behind
    (``stop``, ``hang``, ``raise``: the peers' or its own) are not drawn: the launcher takes a failure that
    ended two attempts the same way for a bug and stops restarting (:mod:`shardwise.train.recovery`)."""
    faults, resumed = [], 0
    for _ in range(n):
        while True:
            kind, rank = rng.choice(kinds), rng.randrange(world)
            saves = [s for s in range(resumed + 1, steps + 1) if s % every == 0 or s == steps]
            step = rng.choice(saves) if kind == "save" else rng.randint(resumed + 1, steps)
            prev = faults[-1] if faults else None
            leaves_error = {kind, prev.kind if prev else "kill"} <= {"stop", "hang", "raise"}
            if not (prev and leaves_error and prev.rank == rank):
                break
        fault = Fault(kind, step, rank)
        faults.append(fault)
        resumed = resumed_after(fault, resumed, every)
    return faults


def fault_text(faults: list[Fault]) -> str:
    """``run.fault`` for ``faults`` (one per attempt)."""
    return ",".join(f"{f.kind}@{f.step}:r{f.rank}" for f in faults)
