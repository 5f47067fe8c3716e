"""The alpha-beta-gamma cost model of the collective algorithms, its calibration, and the
choice of the fastest algorithm.

A message of b bytes costs ``alpha + b * beta``; reducing b bytes costs ``b * gamma``
(Hockney 1994, "The communication challenge for MPP", Parallel Computing 20(3); with the
reduction term of Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1), §2). Each algorithm's cost is a
``Cost(steps, bytes, reduced)``: its critical path holds ``steps`` messages carrying
``bytes`` in total and ``reduced`` bytes of arithmetic, so its time is
``steps*alpha + bytes*beta + reduced*gamma``. ``sent`` is the most bytes any one rank sends
(what :class:`~.p2p.CommStats` measures). S is the message size in bytes: the vector for
all-reduce / broadcast / reduce, the *full* (N-block) buffer for reduce-scatter, all-gather,
gather, scatter and all-to-all. p is the largest power of two <= N, lg = ceil(log2 N).

==================  ============================  ===================================  ==========
all_reduce          steps                         bytes                                source
==================  ============================  ===================================  ==========
ring                2(N-1)                        2(N-1)/N S                           P&Y 2009 §3
rabenseifner        2 log2 p (+2 if N != p)       2(p-1)/p S (+2S)                     Thakur §4.4
recursive_doubling  log2 p (+2)                   log2 p S (+2S)                       Thakur §4.4
tree                2 lg                          2 lg S                               Thakur §3
naive               N-1 (concurrent)              (N-1) S                              direct
star                2(N-1) (through the manager)  2(N-1) S                             Li 2014
hierarchical        2 lg L + 2(M-1)               2 lg L S + 2(M-1)/M S                M nodes of L
torus (R x C)       2(C-1) + 2(R-1)               2(C-1)/C S + 2(R-1)/R S/C            Mikami 2018
==================  ============================  ===================================  ==========

Reduce-scatter / all-gather: ring N-1 steps, (N-1)/N S; halving / doubling log2 p steps,
(p-1)/p S. Broadcast / reduce: binomial tree lg steps of S; pipelined chain with k chunks
N+k-2 steps of S/k (Thakur §3; Chan et al. 2007 §4). Gather / scatter / all-to-all (linear,
pairwise): N-1 steps, (N-1)/N S. Barrier (dissemination): lg steps of no payload.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .allreduce import ALL_REDUCE_ALGORITHMS, torus_shape
from .collectives import ALGORITHMS
from .p2p import DEFAULT_CHUNK_BYTES, exchange, largest_pow2, make_comm


@dataclass(frozen=True)
class Cost:
    steps: float
    """Messages on the critical path (each costs alpha)."""
    bytes: float
    """Bytes on the critical path (each costs beta)."""
    reduced: float = 0.0
    """Bytes reduced on the critical path (each costs gamma)."""
    sent: float = 0.0
    """The most bytes any single rank sends."""


def _lg(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def cost(collective: str, algorithm: str, nbytes: float, n: int, node_size: int | None = None,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Cost:
    """The classic step / byte counts of ``algorithm`` for ``collective`` on ``n`` ranks (table above)."""
    S = float(nbytes)
    p = largest_pow2(n)
    fold = n != p
    lgp = int(math.log2(p))
    if n == 1:
        return Cost(0, 0, 0, 0)
    if collective == "all_reduce":
        if algorithm in ("ring", "native"):
            b = 2 * (n - 1) / n * S
            return Cost(2 * (n - 1), b, (n - 1) / n * S, b)
        if algorithm == "rabenseifner":
            b = 2 * (p - 1) / p * S + (2 * S if fold else 0)
            return Cost(2 * lgp + 2 * fold, b, (p - 1) / p * S + S * fold, b - S * fold)
        if algorithm == "recursive_doubling":
            b = lgp * S + (2 * S if fold else 0)
            return Cost(lgp + 2 * fold, b, lgp * S + S * fold, b - S * fold)
        if algorithm == "tree":
            return Cost(2 * _lg(n), 2 * _lg(n) * S, _lg(n) * S, _lg(n) * S)  # the root broadcasts lg times
        if algorithm == "naive":
            return Cost(n - 1, (n - 1) * S, (n - 1) * S, (n - 1) * S)
        if algorithm == "star":
            return Cost(2 * (n - 1), 2 * (n - 1) * S, (n - 1) * S, (n - 1) * S)
        if algorithm == "hierarchical":
            L = max(1, min(node_size or 2, n))
            M = math.ceil(n / L)
            ring_b = 2 * (M - 1) / M * S
            return Cost(2 * _lg(L) + 2 * (M - 1), 2 * _lg(L) * S + ring_b, _lg(L) * S + (M - 1) / M * S,
                        ring_b + _lg(L) * S)  # a node leader: its ring share, then its broadcasts
        if algorithm == "torus":
            R, C = torus_shape(n, node_size)
            b = 2 * (C - 1) / C * S + 2 * (R - 1) / R * S / C
            return Cost(2 * (C - 1) + 2 * (R - 1), b, (C - 1) / C * S + (R - 1) / R * S / C, b)
    elif collective in ("reduce_scatter", "all_gather"):
        red = collective == "reduce_scatter"
        if algorithm in ("ring", "native"):
            b = (n - 1) / n * S
            return Cost(n - 1, b, b if red else 0, b)
        b = (p - 1) / p * S + ((S + S / n) if fold else 0)
        return Cost(lgp + 2 * fold, b, ((p - 1) / p * S + S * fold) if red else 0, b)
    elif collective in ("broadcast", "reduce"):
        red = collective == "reduce"
        if algorithm in ("tree", "native"):
            lg = _lg(n)
            return Cost(lg, lg * S, lg * S if red else 0, lg * S)
        k = max(1, math.ceil(S / chunk_bytes))
        return Cost(n + k - 2, (n + k - 2) * S / k, (n + k - 2) * S / k if red else 0, S)
    elif collective in ("gather", "scatter", "all_to_all"):
        b = (n - 1) / n * S
        return Cost(n - 1, b, 0, b)
    elif collective == "barrier":
        return Cost(_lg(n), 0, 0, 0)
    raise ValueError(f"no cost formula for {collective}/{algorithm}")


@dataclass
class CostModel:
    """Calibrated constants of one process group (identical on every rank)."""

    alpha: float
    """Seconds per message."""
    beta: float
    """Seconds per byte sent."""
    gamma: float
    """Seconds per byte reduced."""
    world_size: int
    native: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per collective, the backend's own measured ``(seconds, seconds per byte)`` line."""
    margin: float = 0.8
    """:meth:`choose` takes one of ours over native only if predicted faster than ``margin`` x native."""
    efficiency: tuple[float, float] = (1.0, 1.0)
    """Measured / modelled time of our ring all-reduce, for the latency part and for the byte part:
    what the ideal formulas miss of our implementation (Python dispatch, copies); applied to all of ours."""

    def predict(self, collective: str, algorithm: str, nbytes: float, node_size: int | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> float:
        """Predicted seconds of one call."""
        if algorithm == "native" and collective in self.native:
            a, b = self.native[collective]
            return a + b * nbytes
        c = cost(collective, algorithm, nbytes, self.world_size, node_size, chunk_bytes)
        k_lat, k_bytes = self.efficiency if algorithm != "native" else (1.0, 1.0)
        return k_lat * c.steps * self.alpha + k_bytes * (c.bytes * self.beta + c.reduced * self.gamma)

    def choose(self, collective: str, nbytes: float, candidates: tuple[str, ...] | None = None,
               node_size: int | None = None) -> str:
        """The candidate with the lowest predicted time; native wins unless beaten by ``margin``."""
        names = candidates or (ALL_REDUCE_ALGORITHMS if collective == "all_reduce" else ALGORITHMS[collective])
        best = "native" if "native" in names else names[0]
        best_t = self.predict(collective, best, nbytes, node_size) * (self.margin if best == "native" else 1.0)
        for name in names:
            t = self.predict(collective, name, nbytes, node_size)
            if t < best_t:
                best, best_t = name, t
        return best


def choose(collective: str, nbytes: float, group: dist.ProcessGroup | None = None, model: CostModel | None = None,
           candidates: tuple[str, ...] | None = None, node_size: int | None = None) -> str:
    """The algorithm with the lowest predicted time for ``nbytes`` on ``group``.

    Without ``model`` the group is calibrated first (a collective call: every rank must call).
    """
    model = model or calibrate(group)
    return model.choose(collective, nbytes, candidates, node_size)


def _time(fn, reps: int) -> float:
    """Best of ``reps`` (after a warm-up): on a shared machine noise only adds time."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples)


def _agree(group, values: list[float]) -> list[float]:
    """The maximum over ranks, so every rank holds the same model (and makes the same choices)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def calibrate(group: dist.ProcessGroup | None = None, small: int = 8, large: int = 4 << 20, reps: int = 5,
              collectives: tuple[str, ...] = ("all_reduce",)) -> CostModel:
    """Measure alpha, beta and gamma on ``group`` (collective: every rank calls it).

    alpha and beta come from a ring shift (every rank sends to its successor and receives
    from its predecessor) of ``small`` and ``large`` bytes; gamma from adding two ``large``-byte
    fp32 vectors; our ring all-reduce at both sizes gives the model's ``efficiency`` factors;
    the native collectives are timed at both sizes too (a latency + per-byte line each). Best
    of ``reps`` runs, then the maximum over ranks (so every rank holds the same model).
    """
    n = dist.get_world_size(group)
    if n == 1:
        return CostModel(0.0, 0.0, 0.0, 1)
    c = make_comm(group, "calibrate", chunk_bytes=1 << 62)
    right, left = (c.me + 1) % n, (c.me - 1) % n
    sa, ra = torch.zeros(max(small // 4, 1)), torch.zeros(max(small // 4, 1))
    sb, rb = torch.zeros(large // 4), torch.zeros(large // 4)
    t_small = _time(lambda: exchange(c, sa, right, ra, left), reps * 4)
    t_large = _time(lambda: exchange(c, sb, right, rb, left), reps)
    t_add = _time(lambda: rb.add_(sb), reps)
    values = [t_small, max(t_large - t_small, 1e-12) / (large - small), t_add / large]
    from .allreduce import all_reduce

    ring = []
    for v in (ra, rb):
        ring.append(_time(lambda v=v: all_reduce(v, group=group, algorithm="ring"), reps))
    natives = []
    for coll in collectives:
        natives += _native_line(coll, group, n, small, large, reps)
    values = _agree(group, values + ring + natives)
    model = CostModel(values[0], values[1], values[2], n)
    ideal_small, ideal_large = (cost("all_reduce", "ring", s, n) for s in (small, large))
    k_lat = values[3] / max(ideal_small.steps * model.alpha, 1e-12)
    byte_part = ideal_large.bytes * model.beta + ideal_large.reduced * model.gamma
    k_bytes = (values[4] - k_lat * ideal_large.steps * model.alpha) / max(byte_part, 1e-12)
    model.efficiency = (max(k_lat, 1.0), max(k_bytes, 1.0))
    for i, coll in enumerate(collectives):
        a_small, a_large = values[5 + 2 * i], values[6 + 2 * i]
        slope = max(a_large - a_small, 0.0) / (large - small)
        model.native[coll] = (max(a_small - slope * small, 0.0), slope)
    return model


def _native_line(collective: str, group, n: int, small: int, large: int, reps: int) -> list[float]:
    """Median seconds of the native ``collective`` at ``small`` and ``large`` bytes."""
    from .bench import run_collective

    out = []
    for nbytes in (small, large):
        out.append(_time(run_collective(collective, "native", nbytes, group, n), reps))
    return out
