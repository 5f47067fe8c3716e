"""The attention core a context-parallel rank runs in place of :meth:`shardwise.model.layers.Attention.core`.

:class:`ContextAttention` holds what every algorithm needs -- the cp group and this rank's neighbours,
the sequence layout, the counting-layer stats of the ``cp`` axis -- and keeps two records of the attention
work of its forward passes:

* **tiles**, counted: the score entries of the blocks it computed, in units of ``c x c`` tiles, ``c`` the
  length of one head-tail chunk (``T / 2cp``), a causal (diagonal) tile counting half -- the arithmetic of
  the blocks' shapes, what the layout promises. With head-tail balance every rank does ``2 cp`` tiles per
  layer and micro-batch; with a contiguous split rank ``r`` does ``4 r + 2``;
* **seconds**, measured: the clock around every block computation (:mod:`shardwise.dist.clock`: the host's on
  a CPU, CUDA events on a GPU), what the rank really spent -- the same imbalance seen by a clock, noise included.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.dist.clock import Clock, clock_for
from shardwise.dist.comm.counting import CommStats, nbytes
from shardwise.model.scores import PLAIN, ScoreRule
from shardwise.parallel.context.blocks import BlockPair
from shardwise.parallel.context.layout import SequenceLayout

ALGORITHMS = ("ring", "allgather", "ulysses")


@dataclass(eq=False)
class ContextAttention:
    """``core(q, k, v)`` on ``[B, H, t, d]`` heads of this rank's ``t`` tokens: causal (or, for an encoder,
    bidirectional) attention over the whole sequence by ``algorithm`` ("ring", "allgather" or "ulysses"),
    with the probabilities' dropout when given one (:class:`~shardwise.model.dropout.AttentionDropout`)."""

    algorithm: str
    layout: SequenceLayout
    group: object
    ranks: list[int]
    stats: CommStats | None = None
    causal: bool = True
    """False for an encoder (bert): every query attends to every key."""
    work: float = field(default=0.0)
    """Forward score tiles computed since the last :func:`pop_attention_work` (see the module docstring)."""
    saved_bytes: int = 0
    """Bytes of the tensors autograd kept for backward from this core's forward calls (measured by
    ``saved_tensors_hooks``: every tensor saved by an op or by ``ctx.save_for_backward``, once per view).
    Under activation checkpointing they are handed to the checkpoint, which keeps them only while it
    recomputes that layer in backward."""
    calls: int = 0
    """Forward calls with gradients since the last pop (one per layer and micro-batch, more when recomputed)."""
    _stamps: list = field(default_factory=list, repr=False)
    """(start, end) stamps of the blocks timed since the last pop, on :attr:`_clock`."""
    _clock: Clock | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"parallel.cp_algorithm={self.algorithm!r} is not valid; "
                             f"use one of {', '.join(ALGORITHMS)}")

    @property
    def size(self) -> int:
        return self.layout.cp

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]

    def count_send(self, t: torch.Tensor) -> None:
        if self.stats is not None:
            self.stats.hand(nbytes(t), backend=False)
            self.stats.send(nbytes(t))

    def _tile(self, t: int) -> float:
        return (t / 2) ** 2  # c = t / 2 = T / 2cp

    def count_work(self, pair: BlockPair, t: int) -> None:
        self.work += pair.work(t, t) / self._tile(t)

    @contextmanager
    def timed(self, like: torch.Tensor):
        """Measure the time of the block computed inside (``like``: one of its tensors, for the device's clock:
        :mod:`shardwise.dist.clock`, stamps read after the step, :meth:`pop_stamps`; nothing waited for here)."""
        if self._clock is None:
            self._clock = clock_for(like.device)
        start = self._clock.stamp()
        yield
        self._stamps.append((start, self._clock.stamp()))

    def pop_stamps(self) -> tuple[Clock | None, list]:
        """The clock and the (start, end) stamps of the blocks timed since the last pop (nothing read yet)."""
        out, self._stamps = self._stamps, []
        return self._clock, out

    def pop_seconds(self) -> float:
        """The measured block time since the last pop (the stamps read here, at most one wait for the device)."""
        clock, stamps = self.pop_stamps()
        return sum(clock.durations(stamps)) if stamps else 0.0

    def count_whole(self, seq: int, fraction: float) -> None:
        """A ``seq x seq`` attention (causal: half of it) over ``fraction`` of the heads (Ulysses)."""
        self.work += seq * seq * (0.5 if self.causal else 1.0) * fraction / self._tile(seq // self.size)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 drop=None, rule: ScoreRule | None = None) -> torch.Tensor:
        if mask is not None:  # the config refuses cp with classification, the one objective with padding
            raise ValueError("context-parallel attention takes no padding mask: its keys are split over the ranks")
        rule = PLAIN if rule is None else rule
        if not torch.is_grad_enabled():
            return self._attend(q, k, v, drop, rule)
        seen: set = set()
        # only the innermost hooks apply: chain to an enclosing pair (activation checkpointing's) so it still acts
        outer_pack, outer_unpack = torch._C._autograd._top_saved_tensors_default_hooks(False) or (None, None)

        def pack(t: torch.Tensor):
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            if key not in seen:
                seen.add(key)
                self.saved_bytes += nbytes(t)
            return t if outer_pack is None else outer_pack(t)

        def unpack(x):
            return x if outer_unpack is None else outer_unpack(x)

        self.calls += 1
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self._attend(q, k, v, drop, rule)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, drop, rule: ScoreRule) -> torch.Tensor:
        if self.algorithm == "ring":
            from shardwise.parallel.context.ring import RingAttentionFunction

            if not rule.plain or k.shape != v.shape:
                raise ValueError("ring attention computes plain blocks of equal key and value widths; the config "
                                 "refuses a sliding window, soft-capping or latent attention with it")
            return RingAttentionFunction.apply(q, k, v, self, drop, rule.scale_for(q.shape[-1]))
        if self.algorithm == "allgather":
            from shardwise.parallel.context.allgather import allgather_attention

            return allgather_attention(q, k, v, self, drop, rule)
        from shardwise.parallel.context.ulysses import ulysses_attention

        return ulysses_attention(q, k, v, self, drop, rule)


def pop_attention_work(module: torch.nn.Module) -> Callable[[], dict[str, float]]:
    """This step's attention work of the context-parallel cores in ``module``, counters reset, as the reader of its
    metrics (``{}`` without context parallelism): call it once the device is past the step -- the loop reads it
    one step late (:class:`~shardwise.train.readout.Late`), when the blocks' clock stamps are done, so nothing
    waits for the device.

    * ``cp_attn_tiles``: this rank's forward score tiles, counted from the blocks it computed;
      ``cp_attn_tiles_max`` / ``_min`` over its cp group and their ratio ``cp_attn_tile_imbalance``;
    * ``cp_attn_s``: this rank's forward attention time, measured around every block; ``cp_attn_s_max`` /
      ``_min`` over its cp group and their ratio ``cp_attn_time_imbalance`` (a clock on a shared machine:
      noisy where the tiles are exact);
    * ``cp_attn_act_bytes``: bytes the cores keep for backward per micro-batch, over all this rank's layers
      (measured, see :attr:`ContextAttention.saved_bytes`).

    The maxima and minima are gathered over the cp group when the reader runs: a collective (of host tensors)
    that every cp rank calls at the same point of the loop; bookkeeping, not counted as the technique's traffic."""
    from shardwise.model.layers import Attention

    cores, layers = {}, {}
    for m in module.modules():
        if isinstance(m, Attention):
            core = m.__dict__.get("core")
            while core is not None and not isinstance(core, ContextAttention):
                core = getattr(core, "__wrapped__", None)  # selective recompute wraps it
            if core is not None:
                cores[id(core)] = core
                layers[id(core)] = layers.get(id(core), 0) + 1
    if not cores:
        return dict
    total = sum(c.work for c in cores.values())
    timed = [c.pop_stamps() for c in cores.values()]
    act = sum(c.saved_bytes / c.calls * layers[i] for i, c in cores.items() if c.calls)
    for c in cores.values():
        c.work, c.saved_bytes, c.calls = 0.0, 0, 0
    core = next(iter(cores.values()))
    return lambda: _attention_metrics(core, total, timed, act)


def _attention_metrics(core: ContextAttention, total: float, timed: list[tuple[Clock | None, list]],
                       act: float) -> dict[str, float]:
    seconds = sum(sum(clock.durations(stamps)) for clock, stamps in timed if stamps)
    # host tensors (the group's gloo side on a GPU machine): two numbers need no upload and no read back
    mine = torch.tensor([total, seconds], dtype=torch.float64)
    gathered = torch.zeros(core.size * 2, dtype=torch.float64)
    dist.all_gather_single(gathered, mine, group=core.group)
    tiles, times = gathered.view(core.size, 2).unbind(1)
    out = {"cp_attn_act_bytes": float(act)}
    for name, mine_value, every in (("cp_attn_tiles", total, tiles), ("cp_attn_s", seconds, times)):
        hi, lo = float(every.max()), float(every.min())
        ratio = "cp_attn_tile_imbalance" if name == "cp_attn_tiles" else "cp_attn_time_imbalance"
        out.update({name: float(mine_value), f"{name}_max": hi, f"{name}_min": lo,
                    ratio: hi / lo if lo else float("inf")})
    return out


class ContextParallelLoss:
    """The loss of a context-parallel rank: the mean over the *whole* sequence's tokens of its replica.

    This rank holds ``1/cp`` of each sequence; it returns ``cp * (its loss sum) / (token count over the cp
    group)``, so that the average over the cp ranks (what the gradient reduction over dp x cp computes) is
    the sum over the sequence divided by its token count -- exact also when ranks hold different numbers
    of labelled tokens. Wraps the model's loss (a vocabulary-parallel one under tensor parallelism)."""

    def __init__(self, inner, group, cp: int, stats: CommStats | None = None):
        self.inner, self.group, self.cp, self.stats = inner, group, cp, stats

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if hasattr(self.inner, "sum_and_count"):
            total, count = self.inner.sum_and_count(logits, targets)
        else:
            total = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                      ignore_index=-100, reduction="sum")
            count = (targets != -100).sum()
        count = count.detach().clone()
        if self.stats is not None:
            self.stats.hand(nbytes(count), backend=True)
        dist.all_reduce(count, group=self.group)
        return total * self.cp / count

    def __repr__(self) -> str:
        return f"ContextParallelLoss(cp={self.cp}, inner={self.inner!r})"
