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
pairwise): N-1 steps, (N-1)/N S; gather / scatter binomial tree: lg steps, (N-1)/N S (Chan §4.1).
Barrier (dissemination): lg steps of no payload.

A group spanning several nodes is a two-level network: there :class:`CostModel` times each all-reduce
algorithm by its schedule on the measured intra- and inter-node links (:mod:`.twolevel`), and these
one-level counts give its arithmetic and copies; the other collectives keep the one-level formulas on
alpha and beta of a flat ring shift, which crosses the nodes and so measures the slower link.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..devices import data_device, exchange_device, synchronize
from .allreduce import ALL_REDUCE_ALGORITHMS, torus_shape
from .collectives import ALGORITHMS
from .fit import calibration_sizes, fit_line, fit_regimes, relative_errors
from .p2p import DEFAULT_CHUNK_BYTES, exchange, largest_pow2, make_comm
from .twolevel import Levels, calibrate_levels, group_nodes, regular_node_size
from .workload import run_collective

__all__ = ["Cost", "CostModel", "calibrate", "calibration_sizes", "choose", "cost", "fit_line", "fit_regimes",
           "relative_errors", "total_bytes"]


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
    copied: float = 0.0
    """Bytes written into freshly allocated buffers on the critical path (each costs delta): the
    full-size receive buffers and clones of naive, star and recursive doubling; zero for the
    algorithms that work in place (ring, Rabenseifner, trees, hierarchical, torus)."""
    total: float = 0.0
    """Bytes sent by all ranks together (0: not modelled). On one shared-memory host every
    transfer is a copy by the same few cores, so throughput is bounded by this total rather than
    by the busiest link (see :attr:`CostModel.shared_host`)."""


def _lg(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def cost(collective: str, algorithm: str, nbytes: float, n: int, node_size: int | None = None,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Cost:
    """The classic step / byte counts of ``algorithm`` for ``collective`` on ``n`` ranks (table above)."""
    c = _classic(collective, algorithm, nbytes, n, node_size, chunk_bytes)
    if collective == "all_reduce" and n > 1:
        return replace(c, total=total_bytes(algorithm, float(nbytes), n))
    return c


def total_bytes(algorithm: str, S: float, n: int) -> float:
    """Bytes all ``n`` ranks send together in one all-reduce of S bytes: 2(N-1) S for every
    algorithm that moves each rank's contribution once and the result back once (ring,
    Rabenseifner with its fold, binomial tree, star, hierarchical, torus -- the reduce-scatter +
    all-gather lower bound of Patarasuk & Yuan 2009, §2); N(N-1) S for naive; p log2 p S + 2r S
    for recursive doubling (p = largest power of two, r = N - p folded ranks)."""
    if algorithm == "naive":
        return n * (n - 1) * S
    if algorithm == "recursive_doubling":
        p = largest_pow2(n)
        return p * math.log2(p) * S + 2 * (n - p) * S
    return 2 * (n - 1) * S


def _classic(collective: str, algorithm: str, nbytes: float, n: int, node_size: int | None,
             chunk_bytes: int) -> Cost:
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
            return Cost(lgp + 2 * fold, b, lgp * S + S * fold, b - S * fold, lgp * S)  # a clone per round
        if algorithm == "tree":
            return Cost(2 * _lg(n), 2 * _lg(n) * S, _lg(n) * S, _lg(n) * S)  # the root broadcasts lg times
        if algorithm == "naive":
            return Cost(n - 1, (n - 1) * S, (n - 1) * S, (n - 1) * S, (n + 1) * S)  # N-1 buffers, sum, copy back
        if algorithm == "star":
            return Cost(2 * (n - 1), 2 * (n - 1) * S, (n - 1) * S, (n - 1) * S, (n + 1) * S)  # at the manager
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
    elif collective in ("gather", "scatter") and algorithm == "tree":  # binomial: the root's link carries it all
        b = (n - 1) / n * S
        biggest = max(min(v & -v, n - v) for v in range(1, n))  # the largest subtree a non-root forwards
        return Cost(_lg(n), b, 0, b if collective == "scatter" else biggest * S / n)
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
    """:meth:`choose` takes one of ours over native only if predicted faster than ``margin`` x native,
    and than ``1 / (1 + e)`` x native, e the model's demonstrated error near the size in comparing one
    of ours with native (see :attr:`errors`), so that a choice is never made on a predicted gain smaller
    than that error. :func:`calibrate` sets it to 0.9 on a group spanning nodes (a gain under 10 % is not
    worth leaving the backend's own for) and keeps 0.8 on one node (the one-level rule, unchanged)."""
    errors: tuple[tuple[int, float], ...] = ()
    """``(size, e)`` per calibration size. Across nodes, how wrong the model was there in comparing ours
    with native -- for all-reduce the relative error of the predicted ratio ring / native against the
    measured one (a link effect both share, such as a token-bucket burst, cancels in it), for the other
    collectives the two fits' errors compounded, ``(1 + e_ring)(1 + e_native) - 1`` -- and the margin
    at S uses the calibration sizes bracketing S only (a scheduler hiccup at 64 KiB says nothing about
    64 MiB). On one node (the one-level rule): ``(1 + w)^2 - 1`` at every size, w the worst error of
    the fits at any size."""
    efficiency: tuple[float, float] = (1.0, 1.0)
    """Measured / modelled time of our ring all-reduce, for the latency part and for the byte part:
    what the ideal formulas miss of our implementation (Python dispatch, copies); applied to all of ours."""
    delta: float = 0.0
    """Seconds per byte written into a fresh buffer (allocation, first-touch page faults, copy):
    the memory-copy cost, separate from the transfer (beta) and the reduction (gamma)."""
    shared_host: bool = False
    """Every rank of the group on one host (as :func:`calibrate` finds out): transfers are memory
    copies by the same cores, so an algorithm's bytes cost ``total / N`` (its share of all the bytes
    moved, which for the calibrating ring equals its critical path) instead of its critical-path
    bytes -- a tree's serialised transfers are no slower than a ring's concurrent ones there."""
    overhead: float = 0.0
    """Seconds per call of one of ours beyond its messages (argument checks, views, scratch buffers):
    the part of our ring all-reduce's fitted latency that its 2(N-1) alphas do not explain."""
    levels: Levels | None = None
    """The group spans several nodes: their measured link constants, on which the all-reduce
    algorithms are timed by their schedules (:mod:`.twolevel`); None on one node."""

    @property
    def node_size(self) -> int | None:
        """Ranks per node when the group is runs of equal nodes (what hierarchical / torus are shaped by)."""
        return regular_node_size(self.levels.nodes) if self.levels else None

    def _ideal(self, collective: str, algorithm: str, nbytes: float, node_size: int | None,
               chunk_bytes: int) -> tuple[Cost, float, float]:
        """The one-level counts, and the ideal latency and bandwidth + arithmetic seconds."""
        c = cost(collective, algorithm, nbytes, self.world_size, node_size, chunk_bytes)
        if self.levels is not None and collective == "all_reduce":
            lat, bw = self.levels.time(algorithm, nbytes, node_size or self.node_size)
            return c, lat, bw + c.reduced * self.gamma
        moved = c.total / self.world_size if self.shared_host and c.total else c.bytes
        return c, c.steps * self.alpha, moved * self.beta + c.reduced * self.gamma

    def margin_at(self, nbytes: float) -> float:
        """The margin for a choice at ``nbytes``: :attr:`margin`, lowered by the errors at the calibration
        sizes on either side of it (the nearest one beyond the measured range)."""
        if not self.errors:
            return self.margin
        below = [e for size, e in self.errors if size <= nbytes][-1:]
        above = [e for size, e in self.errors if size >= nbytes][:1]
        return min(self.margin, 1.0 / (1.0 + max(below + above)))

    def predict(self, collective: str, algorithm: str, nbytes: float, node_size: int | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> float:
        """Predicted seconds of one call."""
        if algorithm == "native" and collective in self.native:
            a, b = self.native[collective]
            return a + b * nbytes
        c, lat, bw = self._ideal(collective, algorithm, nbytes, node_size, chunk_bytes)
        k_lat, k_bytes = self.efficiency if algorithm != "native" else (1.0, 1.0)
        fixed = self.overhead if algorithm != "native" else 0.0
        return fixed + k_lat * lat + k_bytes * bw + c.copied * self.delta

    def choose(self, collective: str, nbytes: float, candidates: tuple[str, ...] | None = None,
               node_size: int | None = None) -> str:
        """The candidate with the lowest predicted time; native wins unless beaten by ``margin``."""
        names = candidates or (ALL_REDUCE_ALGORITHMS if collective == "all_reduce" else ALGORITHMS[collective])
        best = "native" if "native" in names else names[0]
        node_size = node_size or self.node_size
        best_t = self.predict(collective, best, nbytes, node_size) * (self.margin_at(nbytes) if best == "native"
                                                                       else 1.0)
        for name in names:
            t = self.predict(collective, name, nbytes, node_size)
            if t < best_t:
                best, best_t = name, t
        return best


def choose(collective: str, nbytes: float, group: dist.ProcessGroup | None = None, model: CostModel | None = None,
           candidates: tuple[str, ...] | None = None, node_size: int | None = None,
           local_world_size: int | None = None) -> str:
    """The algorithm with the lowest predicted time for ``nbytes`` on ``group``.

    Without ``model`` the group is calibrated first (a collective call: every rank must call).
    """
    model = model or calibrate(group, local_world_size=local_world_size)
    return model.choose(collective, nbytes, candidates, node_size)


def _time(fn, reps: int, device: torch.device | None = None) -> float:
    """Best of ``reps`` (after a warm-up): on a shared machine noise only adds time. On a GPU
    ``device`` each run is waited for (its kernels are asynchronous)."""
    device = device or torch.device("cpu")
    fn()
    samples = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - t0)
    return min(samples)


def _agree(group, values: list[float]) -> list[float]:
    """The maximum over ranks, so every rank holds the same model (and makes the same choices)."""
    t = torch.tensor(values, dtype=torch.float64, device=exchange_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def calibrate(group: dist.ProcessGroup | None = None, small: int = 8, large: int = 4 << 20, reps: int = 5,
              collectives: tuple[str, ...] = ("all_reduce",), device: torch.device | None = None,
              local_world_size: int | None = None) -> CostModel:
    """Measure alpha, beta and gamma on ``group`` (collective: every rank calls it).

    Every quantity is measured at several sizes (:func:`calibration_sizes`, ``small`` .. ``large``)
    and fitted by least squares on relative error (:func:`fit_line`), rather than read off two
    points: alpha and beta from a ring shift (every rank sends to its successor while receiving
    from its predecessor); gamma from adding two vectors in place (the reduction, separate from the
    transfer); delta from copying into a freshly allocated buffer (the memory-copy cost). Then our
    pipelined ring all-reduce is timed at the same sizes and its latency and per-byte parts fitted
    against the model's ``2(N-1) alpha`` and ``bytes beta + reduced gamma``: a latency beyond the
    alphas is a per-call ``overhead``, and the ratios are the model's ``efficiency`` (what the ideal
    formulas miss of our implementation, applied to every algorithm of ours). The native
    collectives get a fitted latency + per-byte line each. ``errors`` records the relative error of
    these fits at every size (the margin of a choice near that size). Best of ``reps`` runs per point,
    then the maximum over ranks (so
    every rank holds the same model and makes the same choices). The fit is linear, so sizes beyond
    ``large`` are extrapolated: pass the largest size you care about as ``large``
    (``shardwise bench comm`` does). The buffers live on ``device`` (default: where the group's
    data lives, :func:`~shardwise.dist.devices.data_device` -- the GPU under nccl), so the model
    describes the transfers it will choose for.

    When the group spans nodes (:func:`.twolevel.group_nodes`: from ``local_world_size``, the
    launcher's ranks per node, else from the host names) each level's links are measured too
    (:func:`.twolevel.calibrate_levels`) and the all-reduce algorithms are timed on both levels.
    """
    from .allreduce import all_reduce

    n = dist.get_world_size(group)
    if n == 1:
        return CostModel(0.0, 0.0, 0.0, 1)
    c = make_comm(group, "calibrate", chunk_bytes=1 << 62)
    right, left = (c.me + 1) % n, (c.me - 1) % n
    sizes = calibration_sizes(small, large)
    device = device or data_device(group)
    big_a, big_b = (torch.zeros(max(large // 4, 1), device=device) for _ in range(2))
    shift, add, ring, copy = [], [], [], []
    for b in sizes:
        sa, sb = big_a[:max(b // 4, 1)], big_b[:max(b // 4, 1)]
        shift.append(_time(lambda sa=sa, sb=sb: exchange(c, sa, right, sb, left), reps * (4 if b < 65536 else 1),
                           device))
        add.append(_time(lambda sa=sa, sb=sb: sb.add_(sa), reps, device))
        copy.append(_time(lambda sa=sa: torch.empty_like(sa).copy_(sa), reps, device))
        ring.append(_time(lambda sb=sb: all_reduce(sb, group=group, algorithm="ring", verify=False), reps, device))
    natives = []
    for coll in collectives:
        natives += [_time(run_collective_native(coll, b, group, n, device), reps, device) for b in sizes]
    k = len(sizes)
    values = _agree(group, shift + add + ring + natives + copy)
    shift, add, ring, copy = values[:k], values[k:2 * k], values[2 * k:3 * k], values[-k:]
    alpha, beta = fit_line([float(b) for b in sizes], shift)
    _, gamma = fit_line([float(b) for b in sizes], add)
    model = CostModel(max(alpha, 1e-9), max(beta, 1e-15), max(gamma, 1e-15), n)
    nodes = group_nodes(group, local_world_size)
    model.shared_host = len(set(nodes)) == 1
    model.delta = fit_line([float(b) for b in sizes], copy)[1]
    xs = [float(b) for b in sizes]
    if not model.shared_host:
        model.levels = calibrate_levels(group, nodes, sizes, reps, device, model.gamma, _time, fit_regimes,
                                        lambda v: _agree(group, v))
        lat = model._ideal("all_reduce", "ring", sizes[0], None, DEFAULT_CHUNK_BYTES)[1]
        per_byte = model._ideal("all_reduce", "ring", sizes[-1], None, DEFAULT_CHUNK_BYTES)[2] / sizes[-1]
    else:
        ideal = [cost("all_reduce", "ring", b, n) for b in sizes]
        lat = ideal[0].steps * model.alpha
        per_byte = (ideal[-1].bytes * model.beta + ideal[-1].reduced * model.gamma) / sizes[-1]
    fit = fit_line if model.shared_host else fit_regimes  # across nodes: the network's two regimes
    a, slope = fit(xs, ring)
    if a >= lat:  # slower than its alphas: a per-call overhead on top of them
        model.efficiency, model.overhead = (1.0, max(slope / per_byte, 0.1)), a - lat
    else:  # faster (steps overlap): a latency efficiency below one
        model.efficiency = (max(a / lat, 0.1), max(slope / per_byte, 0.1))
    ring_pred = [model.predict("all_reduce", "ring", b) for b in sizes]
    worst = [0.0] * k
    for i, coll in enumerate(collectives):
        times = values[(3 + i) * k:(4 + i) * k]
        model.native[coll] = fit(xs, times)
        native_pred = [model.predict(coll, "native", b) for b in sizes]
        if coll == "all_reduce":  # the error of the comparison itself: predicted ring / native vs measured
            errs = [abs((rp / npred) / (rm / max(nm, 1e-12)) - 1)
                    for rp, npred, rm, nm in zip(ring_pred, native_pred, ring, times, strict=True)]
        else:
            errs = [(1 + abs(e1)) * (1 + abs(e2)) - 1 for e1, e2 in
                    zip(relative_errors(ring_pred, ring), relative_errors(native_pred, times), strict=True)]
        worst = [max(a, b) for a, b in zip(worst, errs, strict=True)]
    # switch from native only when the predicted gain beats what the fits got wrong on this group near that size
    model.errors = tuple(zip(sizes, worst, strict=True))
    if model.levels is None:  # one node: the one-level rule, the fits' worst error at any size
        w = max(abs(e) for times, pred in _fits(model, collectives, values, k, sizes, ring, ring_pred)
                for e in relative_errors(pred, times))
        model.errors = tuple((b, (1 + w) ** 2 - 1) for b in sizes)
    else:
        model.margin = 0.9
    return model


def _fits(model: CostModel, collectives: tuple[str, ...], values: list[float], k: int, sizes: list[int],
          ring: list[float], ring_pred: list[float]):
    """``(measured, predicted)`` of our ring all-reduce and of each native collective at the calibration sizes."""
    yield ring, ring_pred
    for i, coll in enumerate(collectives):
        yield values[(3 + i) * k:(4 + i) * k], [model.predict(coll, "native", b) for b in sizes]


def run_collective_native(collective: str, nbytes: int, group, n: int, device: torch.device | None = None):
    """A closure running the backend's own ``collective`` on ``nbytes`` (see :func:`.workload.run_collective`)."""
    return run_collective(collective, "native", nbytes, group, n, device=device)
