"""The two-level network of a group that spans nodes: which rank is on which node, the measured link
constants of each level, and the all-reduce algorithms' schedules timed on them.

A cluster has two kinds of links: inside a node (shared memory, NVLink; fast) and between nodes (one
NIC per node, shared by the node's ranks; slow). An algorithm that is optimal on one level -- the flat
ring, bandwidth-optimal in the one-level alpha-beta model (Patarasuk & Yuan 2009, §3) -- is not on
two: every one of its 2(N-1) steps crosses a node boundary somewhere, so it runs at the inter-node
link's speed throughout, while a hierarchical all-reduce crosses with only 1/L of its steps' worth of
data per rank (Sack & Gropp 2012, "Faster topology-aware collective algorithms through non-minimal
communication", PPoPP, §2-3; the ring / tree split of NCCL, Jeaugey 2019, "Massively scale your deep
learning training with NCCL 2.4"; the 2-D torus of Mikami et al. 2018, §3.2).

The model here: each algorithm is written out as its schedule -- rounds of concurrent point-to-point
messages, the same messages its code in :mod:`.allreduce` sends -- and each round costs the slower of
its two levels:

* inside a node, a rank's messages cost ``alpha_intra + bytes * beta_intra`` each (Hockney 1994);
* between nodes, the *max-rate* model of Gropp, Olson & Samfass 2016 ("Modeling MPI communication
  performance on SMP nodes: is it time to retire the ping pong test", EuroMPI, §3): k ranks of one
  node sending n bytes each across at once take ``alpha_inter + max(n * beta_flow, k n * beta_node)``
  -- one flow is limited by what one rank can drive (``beta_flow``), many by the node's link
  (``beta_node``). Bytes a node receives count like bytes it sends (full duplex, per direction).

The constants are measured on the running group by :func:`calibrate_levels` (ring all-reduces inside
the nodes, across them with one rank per node, and across them with every rank at once), not assumed. Nodes are
found from the launcher's ranks per node (``LOCAL_WORLD_SIZE``: torchrun numbers the ranks of a node
consecutively) or, without it, from the host names, and handed in -- never read from a global.
"""

from __future__ import annotations

import math
import socket
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .p2p import largest_pow2

Round = tuple[int, list[tuple[int, int, float]]]
"""``(repeat, [(src, dst, bytes), ...])``: a round of concurrent messages, run ``repeat`` times."""


def group_nodes(group: dist.ProcessGroup | None = None, local_world_size: int | None = None) -> tuple[int, ...]:
    """The node of every rank of ``group`` (node ids numbered 0, 1, ... in rank order).

    With ``local_world_size`` (the launcher's ranks per node), global rank r is on node
    ``r // local_world_size`` (torchrun's numbering) and nothing is communicated; without it the ranks'
    host names are all-gathered (a collective: every rank must call). Network namespaces of one machine
    share a host name, so a simulated cluster must pass ``local_world_size``.
    """
    n = dist.get_world_size(group)
    if local_world_size:
        keys: list = [(dist.get_global_rank(group, i) if group is not None else i) // local_world_size
                      for i in range(n)]
    else:
        keys = [None] * n
        dist.all_gather_object(keys, socket.gethostname(), group=group)
    first: dict = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def regular_node_size(nodes: tuple[int, ...]) -> int | None:
    """L when the ranks form runs of L consecutive ranks per node, all of the same size; else None."""
    n = len(nodes)
    sizes = Counter(nodes)
    L = sizes[nodes[0]]
    if n % L or any(nodes[i] != i // L for i in range(n)):
        return None
    return L


@dataclass(frozen=True)
class Levels:
    """Measured constants of the two levels (identical on every rank)."""

    nodes: tuple[int, ...]
    """The node of each rank of the group."""
    alpha_intra: float
    beta_intra: float
    """Seconds per message / per byte between two ranks of one node (every node's ranks busy at once)."""
    alpha_inter: float
    beta_flow: float
    """Seconds per message / per byte of one rank's flow to another node (alone on its node's link)."""
    beta_node: float
    """Seconds per byte through one node's link to another node, whoever sends: with k flows at once,
    each byte of one flow costs ``max(beta_flow, k * beta_node)`` (the max-rate model)."""

    def round_time(self, msgs: list[tuple[int, int, float]]) -> tuple[float, float]:
        """``(latency, bandwidth)`` seconds of one round: those of its slower level."""
        count: dict = {}
        for src, dst, b in msgs:
            level = "a" if self.nodes[src] == self.nodes[dst] else "e"
            for rank, way in ((src, "out"), (dst, "in")):
                k = (level, way, rank)
                m, s = count.get(k, (0, 0.0))
                count[k] = (m + 1, s + b)
            if level == "e":
                for node, way in ((self.nodes[src], "out"), (self.nodes[dst], "in")):
                    k = ("node", way, node)
                    count[k] = (count.get(k, (0, 0.0))[0] + 1, count.get(k, (0, 0.0))[1] + b)
        intra, inter = (0.0, 0.0), (0.0, 0.0)
        for (level, way, who), (m, s) in count.items():
            if level == "a":
                intra = max(intra, (m * self.alpha_intra, s * self.beta_intra), key=sum)
            elif level == "e":
                node_bytes = count[("node", way, self.nodes[who])][1]
                inter = max(inter, (m * self.alpha_inter, max(s * self.beta_flow, node_bytes * self.beta_node)),
                            key=sum)
        return max(intra, inter, key=sum)

    def time(self, algorithm: str, nbytes: float, node_size: int | None = None) -> tuple[float, float]:
        """``(latency, bandwidth)`` seconds of ``algorithm``'s all-reduce of ``nbytes`` (arithmetic apart)."""
        lat = bw = 0.0
        for repeat, msgs in schedule(algorithm, len(self.nodes), float(nbytes), node_size):
            a, b = self.round_time(msgs)
            lat, bw = lat + repeat * a, bw + repeat * b
        return lat, bw


# ---- the schedules: the rounds each algorithm of .allreduce sends ------------------------------------------


def _ring(ranks: list[int], b: float, repeat: int) -> list[Round]:
    m = len(ranks)
    return [(repeat, [(ranks[i], ranks[(i + 1) % m], b) for i in range(m)])] if m > 1 else []


def _tree_reduce(ranks: list[int], b: float) -> list[Round]:
    """Binomial reduce to ranks[0] (:func:`.primitives.tree_reduce`); the broadcast is its reverse."""
    n, out, mask = len(ranks), [], 1
    while mask < n:
        out.append((1, [(ranks[v], ranks[v - mask], b) for v in range(mask, n, 2 * mask)]))
        mask <<= 1
    return out


def _tree_broadcast(ranks: list[int], b: float) -> list[Round]:
    return [(1, [(d, s, x) for s, d, x in msgs]) for _, msgs in reversed(_tree_reduce(ranks, b))]


def _folded(n: int, S: float, body) -> list[Round]:
    """Thakur et al. 2005 §4.4's fold (:func:`.primitives.fold_view`): the even ones of the first 2r
    ranks hand their vector to their odd neighbour, the p-rank body runs on virtual ranks, the result
    goes back."""
    p = largest_pow2(n)
    r = n - p
    real = [2 * v + 1 if v < r else v + r for v in range(p)]
    fold = [(1, [(2 * k, 2 * k + 1, S) for k in range(r)])] if r else []
    unfold = [(1, [(2 * k + 1, 2 * k, S) for k in range(r)])] if r else []
    return fold + [(rep, [(real[s], real[d], b) for s, d, b in msgs]) for rep, msgs in body(p)] + unfold


def schedule(algorithm: str, n: int, S: float, node_size: int | None = None) -> list[Round]:
    """The rounds of ``algorithm``'s all-reduce of S bytes on n ranks ("native": gloo's ring)."""
    if n == 1:
        return []
    if algorithm in ("ring", "native"):
        return _ring(list(range(n)), S / n, 2 * (n - 1))
    if algorithm == "rabenseifner":  # halving at distances p/2 .. 1, doubling at 1 .. p/2
        def body(p: int) -> list[Round]:
            masks = [1 << i for i in range(int(math.log2(p)))]
            rounds = [(1, [(v, v ^ m, S * m / p) for v in range(p)]) for m in reversed(masks)]
            return rounds + [(1, [(v, v ^ m, S * m / p) for v in range(p)]) for m in masks]
        return _folded(n, S, body)
    if algorithm == "recursive_doubling":
        return _folded(n, S, lambda p: [(1, [(v, v ^ (1 << i), S) for v in range(p)])
                                        for i in range(int(math.log2(p)))])
    if algorithm == "tree":
        return _tree_reduce(list(range(n)), S) + _tree_broadcast(list(range(n)), S)
    if algorithm == "naive":
        return [(1, [(i, j, S) for i in range(n) for j in range(n) if i != j])]
    if algorithm == "star":
        return [(1, [(j, 0, S) for j in range(1, n)]), (1, [(0, j, S) for j in range(1, n)])]
    if algorithm == "hierarchical":  # tree reduce in each node, ring over the leaders, tree broadcast
        L = max(1, min(node_size or 2, n))
        blocks = [list(range(s, min(s + L, n))) for s in range(0, n, L)]
        up = _merge([_tree_reduce(b, S) for b in blocks])
        down = _merge([_tree_broadcast(b, S) for b in blocks])
        return up + _ring([b[0] for b in blocks], S / len(blocks), 2 * (len(blocks) - 1)) + down
    if algorithm == "torus":  # reduce-scatter along rows, all-reduce along columns, all-gather along rows
        from .allreduce import torus_shape

        R, C = torus_shape(n, node_size)
        rows = [list(range(i * C, (i + 1) * C)) for i in range(R)]
        cols = [list(range(j, n, C)) for j in range(C)]
        along_rows = _merge([_ring(r, S / C, C - 1) for r in rows])
        return along_rows + _merge([_ring(c, S / C / R, 2 * (R - 1)) for c in cols]) + along_rows
    raise ValueError(f"no two-level schedule for all_reduce/{algorithm}")


def _merge(parts: list[list[Round]]) -> list[Round]:
    """Run the i-th rounds of independent schedules (disjoint ranks, same shape) at once."""
    out: list[Round] = []
    for i in range(max((len(p) for p in parts), default=0)):
        here = [p[i] for p in parts if i < len(p)]
        out.append((here[0][0], [m for _, msgs in here for m in msgs]))
    return out


# ---- calibration on the running group -------------------------------------------------------------------


def calibrate_levels(group, nodes: tuple[int, ...], sizes: list[int], reps: int, device, gamma: float, timer, fit,
                     agree) -> Levels:
    """Measure the two levels' constants on ``group`` (collective; every rank calls it).

    Each level is timed with the primitive the algorithms are built of, our pipelined ring all-reduce
    (:func:`.allreduce.ring`; measured on gloo, one large unchunked exchange per pair runs at half the
    rate of the same bytes pipelined), at every size of ``sizes``, the three separated by barriers so
    that they never overlap: (1) a ring inside every node at once, for alpha and beta inside a node;
    (2) a ring of the first rank of each node only, for alpha between nodes and one flow's beta; (3) a
    ring across the nodes for every position in the node at once (L flows per node), whose per-flow
    beta divided by L is the node link's. A ring of m ranks takes ``2(m-1) alpha + 2(m-1)/m S beta +
    (m-1)/m S gamma`` (Patarasuk & Yuan 2009, §3), from which alpha and beta are read. ``timer``, ``fit``
    and ``agree`` are :mod:`.cost`'s best-of-reps timer, relative least-squares line and max over ranks.
    """
    from .allreduce import ring
    from .p2p import make_comm

    me = dist.get_rank(group)
    members: dict[int, list[int]] = {}
    for r, nd in enumerate(nodes):
        members.setdefault(nd, []).append(r)
    mine = members[nodes[me]]
    pos = mine.index(me)
    L = min(len(m) for m in members.values())
    M = len(members)
    c = make_comm(group, "calibrate")
    buf = torch.zeros(max(max(sizes) // 4, 1), device=device)

    def series(ranks: list[int] | None) -> list[float]:
        dist.barrier(group=group)
        view = c.sub(ranks) if ranks else None
        out = []
        for size in sizes:
            x = buf[:max(size // 4, 1)]
            out.append(timer(lambda x=x: ring(view, x, "sum"), reps * (4 if size < 65536 else 1), device)
                       if view else 0.0)
        dist.barrier(group=group)
        return out

    intra = series(mine if len(mine) > 1 else None)
    one = series([m[0] for m in members.values()] if pos == 0 else None)
    every = series([m[pos] for m in members.values()] if pos < L else None)
    k = len(sizes)
    values = agree(intra + one + every)
    xs = [float(s) for s in sizes]

    def per_message(times: list[float], m: int) -> tuple[float, float]:
        a, slope = fit(xs, times)
        return a / (2 * (m - 1)), max(slope - (m - 1) / m * gamma, 1e-15) / (2 * (m - 1) / m)

    biggest = max(len(m) for m in members.values())
    alpha_a, beta_a = per_message(values[:k], biggest) if biggest > 1 else (0.0, 0.0)
    alpha_e, beta_1 = per_message(values[k:2 * k], M)
    _, beta_every = per_message(values[2 * k:], M)
    return Levels(nodes, alpha_a, beta_a, alpha_e, beta_1, beta_every / L)
