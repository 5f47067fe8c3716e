"""Links, flows sharing them max-min fairly, and the collectives as rounds of flows on them.

The topology (:class:`Fabric`) of a :class:`~shardwise.sim.hardware.SimHardware`: every GPU has an NVLink
port into its node's NVSwitch (one link out, one in; the switch itself is non-blocking); every node has
``nics`` NICs, one per rail (rail-optimised: GPU i uses the NIC of rail ``i * nics / gpus_per_node``); the
NICs of a rail connect to that rail's leaf switches, ``leaf_nodes`` nodes per leaf, and the leaves to a
spine layer through uplinks of ``leaf_nodes * nic / oversubscription`` bytes/s per leaf (the two-tier fat
tree of Leiserson 1985; ECMP spreads a leaf's flows evenly over its uplinks, so they are modelled as one
aggregate link, and the spine is non-blocking). A flow between GPUs of one node crosses the two NVLink
ports (and the node's shared bus, if the hardware has one); between nodes it crosses the sender's NIC,
its leaf's uplink and the receiver's leaf's downlink unless both share a leaf (same rail, same group of
nodes), and the receiver's NIC.

Flows that share a link share its bandwidth max-min fairly (Bertsekas & Gallager 1992, "Data Networks",
§6.5.2: progressive filling -- raise every unfrozen flow's rate until a link saturates, freeze the flows
through it, repeat); when a flow finishes, the others are refilled (a fluid model). A round of a collective
is its concurrent messages -- of every group of the axis at once (data-parallel replicas all reduce their
gradients together) -- and lasts until its last message arrives, plus one latency alpha (Hockney 1994).
The rounds are those of the algorithm the run uses, as :mod:`shardwise.dist.comm.cost` counts them on one
host (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009): ring all-reduce 2(N-1) rounds of S/N;
ring reduce-scatter / all-gather N-1 rounds of S/N; a two-level all-reduce (reduce-scatter inside each node,
all-reduce across nodes, all-gather inside; Jia et al. 2018 §4.2) where cheaper, as NCCL's tuner or
:meth:`~shardwise.dist.comm.cost.CostModel.choose` would pick it, and the two halves of it as a reduce-scatter
(inside each node, then across the nodes among the ranks of one local index: one rail each) or an all-gather
(across, then inside) where cheaper -- what NCCL's rings, one per rail, move per NIC; pairwise exchanges (gloo
ZeRO, all N-1 blocks at once) and all-to-all (every pair at once); point-to-point sends. Equal messages make a round's
time linear in its bytes, so each distinct round is solved once per byte and cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardwise.sim.hardware import SimHardware

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "pairwise", "send")


@dataclass(frozen=True)
class Round:
    """Concurrent equal messages ``src[i] -> dst[i]`` of ``share`` x S bytes each, run ``repeat`` times."""

    src: np.ndarray
    dst: np.ndarray
    share: float
    repeat: int
    alphas: int = 1
    """Latencies a round costs (a pairwise exchange posts its N-1 messages one after another)."""


class Fabric:
    """The links of one cluster and the time of a collective on them."""

    def __init__(self, hw: SimHardware):
        self.hw = hw
        w, nodes, nics = hw.world, hw.nodes, hw.nics
        self.pods = -(-nodes // hw.leaf_nodes)
        nic = hw.nic_bandwidth
        per_pod = [min(hw.leaf_nodes, nodes - p * hw.leaf_nodes) for p in range(self.pods)]
        leaf = np.array(per_pod * nics, dtype=float) * nic / hw.oversubscription  # index rail * pods + pod
        self._base = {"nvl_out": 0, "nvl_in": w, "nic_out": 2 * w, "nic_in": 2 * w + nodes * nics,
                      "up": 2 * w + 2 * nodes * nics}
        self._base["down"] = self._base["up"] + nics * self.pods
        self._base["bus"] = self._base["down"] + nics * self.pods
        self.capacity = np.concatenate([np.full(2 * w, hw.gpu.intra_bw), np.full(2 * nodes * nics, nic), leaf, leaf,
                                        np.full(nodes, hw.node_bus_bw or np.inf)])
        self._cache: dict = {}

    # ---- paths -------------------------------------------------------------------------------------

    def paths(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(flow index, link index)`` pairs: the links every flow ``src[i] -> dst[i]`` crosses."""
        hw, b = self.hw, self._base
        g, nics = hw.gpus_per_node, hw.nics
        n_s, n_d = src // g, dst // g
        r_s, r_d = (src % g) * nics // g, (dst % g) * nics // g
        p_s, p_d = n_s // hw.leaf_nodes, n_d // hw.leaf_nodes
        idx = np.arange(len(src))
        inside = n_s == n_d
        flows, links = [idx[inside], idx[inside]], [b["nvl_out"] + src[inside], b["nvl_in"] + dst[inside]]
        if hw.node_bus_bw:
            flows.append(idx[inside])
            links.append(b["bus"] + n_s[inside])
        out = ~inside
        flows += [idx[out], idx[out]]
        links += [b["nic_out"] + n_s[out] * nics + r_s[out], b["nic_in"] + n_d[out] * nics + r_d[out]]
        spine = out & ((p_s != p_d) | (r_s != r_d))
        flows += [idx[spine], idx[spine]]
        links += [b["up"] + r_s[spine] * self.pods + p_s[spine], b["down"] + r_d[spine] * self.pods + p_d[spine]]
        return np.concatenate(flows), np.concatenate(links)

    # ---- max-min fair sharing ------------------------------------------------------------------------

    @staticmethod
    def max_min_rates(flow: np.ndarray, link: np.ndarray, capacity: np.ndarray, n_flows: int,
                      active: np.ndarray | None = None) -> np.ndarray:
        """Max-min fair rates of ``n_flows`` flows (progressive filling) over links of ``capacity``;
        ``(flow[k], link[k])`` says flow ``flow[k]`` crosses ``link[k]``. Inactive flows get 0."""
        rate = np.zeros(n_flows)
        frozen = np.zeros(n_flows, bool) if active is None else ~active
        cap = capacity.astype(float).copy()
        on = ~frozen[flow]
        while on.any():
            count = np.bincount(link[on], minlength=len(cap))
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.where(count > 0, cap / np.maximum(count, 1), np.inf)
            s = share.min()
            if not np.isfinite(s):  # flows on unlimited links only
                rate[np.unique(flow[on])] = np.inf
                break
            hit = on & (share[link] <= s * (1 + 1e-9))
            new = np.zeros(n_flows, bool)
            new[flow[hit]] = True
            rate[new] = s
            frozen |= new
            taken = new[flow]
            cap -= np.bincount(link[taken], minlength=len(cap)) * s
            on = ~frozen[flow]
        return rate

    def round_seconds_per_byte(self, src: np.ndarray, dst: np.ndarray) -> float:
        """Seconds until the last of the concurrent flows ``src -> dst`` of one byte each arrives, the rates
        refilled max-min fairly whenever a flow completes (a fluid model: linear in the bytes)."""
        key = (src.tobytes(), dst.tobytes())
        if key in self._cache:
            return self._cache[key]
        flow, link = self.paths(src, dst)
        used, local = np.unique(link, return_inverse=True)
        cap = self.capacity[used]
        n = len(src)
        remaining, active, t = np.ones(n), np.ones(n, bool), 0.0
        while active.any():
            rate = self.max_min_rates(flow, local, cap, n, active)
            if np.isinf(rate[active]).all():
                break
            dt = float((remaining[active] / rate[active]).min())
            t += dt
            remaining[active] -= rate[active] * dt
            active &= remaining > 1e-9
        self._cache[key] = t
        return t

    def latency(self, src: np.ndarray, dst: np.ndarray) -> float:
        """Alpha of a round: the inter-node latency if any message crosses nodes, else the NVLink one."""
        g = self.hw.gpus_per_node
        return self.hw.gpu.inter_latency if np.any(src // g != dst // g) else self.hw.gpu.intra_latency

    # ---- collectives -----------------------------------------------------------------------------------

    def rounds(self, collective: str, groups: Sequence[Sequence[int]], algorithm: str = "ring") -> list[Round]:
        """The rounds of ``collective`` over every group of ``groups`` at once (each group in rank order)."""
        gs = np.asarray(groups, dtype=np.int64)
        n = gs.shape[1]
        if n == 1:
            return []
        if collective == "send":  # groups are (sender, receiver) pairs
            return [Round(gs[:, 0], gs[:, 1], 1.0, 1)]
        if collective in ("all-to-all", "pairwise"):
            i, j = np.nonzero(~np.eye(n, dtype=bool))
            src, dst = gs[:, i].ravel(), gs[:, j].ravel()
            return [Round(src, dst, 1.0 / n, 1, alphas=n - 1 if collective == "pairwise" else 1)]
        ring = (gs, np.roll(gs, -1, axis=1))
        steps = 2 * (n - 1) if collective == "all-reduce" else n - 1
        if algorithm == "hierarchical" and collective in ("all-reduce", "reduce-scatter", "all-gather"):
            rounds = self._two_level(gs)
            if collective == "all-reduce":
                return rounds
            inside = rounds[:1] if len(rounds) == 3 else []
            across = dataclasses.replace(rounds[len(inside)], repeat=rounds[len(inside)].repeat // 2)  # N/L - 1
            return [*inside, across] if collective == "reduce-scatter" else [across, *inside]
        return [Round(ring[0].ravel(), ring[1].ravel(), 1.0 / n, steps)]

    def _two_level(self, gs: np.ndarray) -> list[Round]:
        """Reduce-scatter inside each node, all-reduce of 1/L across the nodes, all-gather inside (L ranks
        of the group per node, the same on every node)."""
        g = self.hw.gpus_per_node
        n = gs.shape[1]
        local = int(np.sum(gs[0] // g == gs[0, 0] // g))
        nodes = n // local
        by_node = gs.reshape(len(gs), nodes, local)
        inside = (by_node.ravel(), np.roll(by_node, -1, axis=2).ravel())
        across = (by_node.transpose(0, 2, 1).ravel(), np.roll(by_node.transpose(0, 2, 1), -1, axis=2).ravel())
        out = [Round(*inside, 1.0 / local, local - 1)] if local > 1 else []
        out.append(Round(*across, 1.0 / (local * nodes), 2 * (nodes - 1)))
        if local > 1:
            out.append(Round(*inside, 1.0 / local, local - 1))
        return out

    def two_level_possible(self, groups: Sequence[Sequence[int]]) -> bool:
        """Whether a group spans several nodes with the same number (> 1) of its ranks on each."""
        g = self.hw.gpus_per_node
        nodes = np.asarray(groups[0]) // g
        _, counts = np.unique(nodes, return_counts=True)
        return len(counts) > 1 and counts[0] > 1 and bool(np.all(counts == counts[0])) and \
            bool(np.all(np.diff(nodes) >= 0))

    def time(self, collective: str, groups: Sequence[Sequence[int]], nbytes: float,
             algorithm: str | None = None, native: bool = False) -> tuple[float, str]:
        """``(seconds, algorithm)`` of one call moving ``nbytes`` (the vector of an all-reduce, the whole
        buffer of a gather / scatter / all-to-all, the message of a send), with every group at once; the
        hardware's per-call latency included. All-reduce: the cheaper of ring and two-level.

        ``native``: the engine hands this call to the backend's own collective. If the hardware holds a
        measured line for it and the group size (``[sim.native_collectives]``, see
        :mod:`shardwise.sim.hardware`), that line is its cost (algorithm "native": measured with every rank of
        the machine busy, so the groups beside it are in the line); else it is costed by the algorithm."""
        if nbytes <= 0 or not groups or len(groups[0]) < 2:
            return 0.0, "none"
        line = self.hw.native_line(collective, len(groups[0])) if native else None
        if line is not None:
            return line.seconds(nbytes), "native"
        if algorithm is None:
            algorithm = "ring"
            if collective in ("all-reduce", "reduce-scatter", "all-gather") and self.two_level_possible(groups):
                ring = self._seconds(self.rounds(collective, groups, "ring"), nbytes)
                two = self._seconds(self.rounds(collective, groups, "hierarchical"), nbytes)
                return self.hw.call_latency + min(ring, two), "ring" if ring <= two else "hierarchical"
        return self.hw.call_latency + self._seconds(self.rounds(collective, groups, algorithm), nbytes), algorithm

    def _seconds(self, rounds: list[Round], nbytes: float) -> float:
        total = 0.0
        for r in rounds:
            per_byte = self.round_seconds_per_byte(r.src, r.dst)
            total += r.repeat * (r.alphas * self.latency(r.src, r.dst) + r.share * nbytes * per_byte)
        return total
