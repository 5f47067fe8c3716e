"""ZeRO-3's gathers and reduce-scatters of one stage, issued where the engine's hooks issue them.

:class:`shardwise.parallel.zero.ZeroDataParallel` at stage 3 (``parallel/zero/stage3.py``, ``reduce.py``;
Rajbhandari et al. 2020 §5.3, Zhao et al. 2023 §3.3) has units in forward order: the root (embeddings, final norm,
head), then each run of ``parallel.zero_unit`` blocks followed, under expert parallelism, by one unit per MoE
block of its experts (sliced over the expert replicas, mesh axis ``edp``). Its hooks:

* the model's pre-forward hook gathers the root and prefetches the first block unit;
* a unit's pre-forward hook (its first block's, or its experts' inside the block) gathers it and prefetches the
  next unit; the root stays gathered to the end of backward, every other unit is freed after its forward;
* a unit's pre-backward hook (the gradient of its output arriving: a block's before its experts') gathers it and
  prefetches the unit before it (not the root);
* once a unit's gradients are complete it is reduce-scattered, in the fixed order last unit first (a unit
  ready early waits for its turn).

The simulator works a piece (the embedding, a block, the head) at a time: a hook firing inside a block is
issued as the block starts, and a reduce-scatter as its backward ends.
"""

from __future__ import annotations

from shardwise.sim.params import RankParams
from shardwise.sim.tasks import Task


def unit_pieces(rp: RankParams, pieces: list) -> tuple[dict, dict, dict]:
    """The units each piece computes with (index order), and each unit's first and last piece in forward order."""
    of: dict = {}
    for u, g in enumerate(rp.groups):
        for pc in dict.fromkeys(rp.pieces[i] for i in g):
            of.setdefault(pc, []).append(u)
    first, last = {}, {}
    for pc in pieces:
        for u in of.get(pc, ()):
            first.setdefault(u, pc)
            last[u] = pc
    return of, first, last


class Stage3Hooks:
    """The gathers and reduce-scatters of rank ``r``'s ZeRO-3 units (``builder``: a
    :class:`~shardwise.sim.step.StepBuilder`) over the forward-ordered ``pieces`` of its one stage."""

    def __init__(self, builder, r: int, pieces: list):
        rp = builder.params[r]
        self.builder, self.r, self.pieces = builder, r, pieces
        self.n = len(rp.groups)
        self.of, self.first, self.last = unit_pieces(rp, pieces)
        self.order = list(reversed(range(self.n)))
        self.mb, self.backward = 0, False
        self.gathers: dict[int, Task] = {}

    def start(self, mb: int, backward: bool) -> None:
        """A pass (micro-batch ``mb``'s forward or backward) begins: no unit gathered yet, none ready to reduce."""
        self.mb, self.backward = mb, backward
        self.gathers = {}
        self.ready: set[int] = set()
        self.launched = 0

    def _gather(self, u: int, deps: list) -> None:
        if u < self.n and u not in self.gathers:  # not gathered (or prefetched) yet in this pass
            name = f"gather {'root' if u == 0 else f'u{u}'}{' bwd' if self.backward else ''} mb{self.mb}"
            self.gathers[u] = self.builder._gather(self.r, u, deps, name, self.backward)

    def before(self, pc, deps: list) -> list[Task]:
        """Issue the gathers of the hooks firing as piece ``pc``'s forward (backward) starts, after ``deps``; return
        the gathers ``pc`` waits for."""
        units = self.of.get(pc, [])
        if not self.backward:
            if pc == self.pieces[0]:  # the model's pre-forward hook
                self._gather(0, deps)
                self._gather(1, deps)
            for u in (u for u in units if u > 0 and self.first[u] == pc):  # a block's, then its experts'
                self._gather(u, deps)
                self._gather(u + 1, deps)
            return [self.gathers[u] for u in units]
        for u in (u for u in units if u > 0 and self.last[u] == pc):  # a block's (its output), then its experts'
            self._gather(u, deps)
            if u - 1 >= 1:
                self._gather(u - 1, deps)
        return [self.gathers[u] for u in units if u > 0]

    def after_backward(self, pc, previous: Task) -> Task:
        """The reduce-scatters of the units piece ``pc``'s backward completes, in the engine's order; where the
        engine's :func:`~shardwise.parallel.zero.reduce.overlaps_reduce` says no (ZeRO-3 on CPU) the backward waits
        for each. Returns what the next computation follows."""
        b = self.builder
        self.ready.update(u for u in self.of.get(pc, ()) if self.first[u] == pc)
        while self.launched < self.n and self.order[self.launched] in self.ready:
            u = self.order[self.launched]
            rs = b._reduce(self.r, u, [previous], f"reduce-scatter u{u}")
            self.launched += 1
            if not b.reduce_overlaps:  # the engine's rule (overlaps_reduce): ZeRO-3 waits on CPU
                previous = b._task(self.r, f"wait u{u}", "wait", [("wait", None, 0.0)], [previous, rs])
        return previous


__all__ = ["Stage3Hooks", "unit_pieces"]
