"""Simulate one training step of a config on a cluster: the step time and where it went.

:func:`load_config` resolves the config exactly as the trainer does (its own checks: a layout the trainer
refuses is refused here, in the same one line) for ``nodes x gpus_per_node`` ranks; :func:`simulate` builds
the step's tasks (:mod:`shardwise.sim.step`), runs the clock (:mod:`shardwise.sim.tasks`) and measures the
result the way the trainer measures a run: step time, tokens/s, MFU with the trainer's FLOPs per token
(:func:`shardwise.train.flops.training_flops_per_token`), the pipeline bubble as
:func:`shardwise.parallel.pipeline.timeline.bubble_fraction` defines it (one minus the stages' busy time
over p times the schedule's span), exposed communication per mesh axis, and peak memory per rank (model
states of the engine's units, the live micro-batches' activations at the schedule's worst moment,
ZeRO-3's gathered units).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardwise.config import Config
from shardwise.config_resolve import resolve
from shardwise.parallel.pipeline.schedules import B, F, W, compute_order
from shardwise.plan.spec import resolved_model
from shardwise.sim import exposure
from shardwise.sim.costs import RankCosts
from shardwise.sim.hardware import SimHardware
from shardwise.sim.network import Fabric
from shardwise.sim.params import EMBED, HEAD, state_bytes
from shardwise.sim.step import StepBuilder
from shardwise.sim.tasks import COMPUTE, Graph, busy_intervals, exposed_comm
from shardwise.train.flops import training_flops_per_token


def read_config(path: str | None, overrides: dict[str, str]) -> Config:
    """The config tree of a file and overrides; a file's planner tables (``[plan]``, ``[cluster]``, ``[sim]``)
    are the commands' own options, not config fields."""
    return Config.load(path, overrides, other_tables=("plan", "cluster", "sim"))


def load_config(path: str | None, overrides: dict[str, str], hw: SimHardware) -> Config:
    """The trainer's resolved config for ``hw.nodes`` nodes of ``hw.gpus_per_node`` ranks."""
    cfg = read_config(path, {**overrides, "parallel.nproc": str(hw.gpus_per_node), "parallel.nnodes": str(hw.nodes)})
    cfg.model = resolved_model(cfg)
    return resolve(cfg, weights=False)


MFU_CONVENTION = ("PaLM (Chowdhery et al. 2022, App. B): 6N + 12·L·h·s FLOPs per token, full attention, "
                  "recomputation not counted")
"""How :attr:`SimResult.mfu` counts a token's FLOPs (the trainer's ``mfu``); ``mfu_causal`` counts 6·L·h·s for the
attention scores and values instead (half of them skipped under a causal mask)."""


@dataclass
class RankReport:
    rank: int
    busy_s: float
    exposed_s: dict[str, float]
    states_bytes: dict[str, float]
    activation_bytes: float
    transient_bytes: float

    @property
    def peak_bytes(self) -> float:
        return sum(self.states_bytes.values()) + self.activation_bytes + self.transient_bytes


@dataclass
class SimResult:
    """One simulated step (``graph`` holds every task with its start and end)."""

    cfg: Config
    hw: SimHardware
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble: float | None
    ranks: list[RankReport]
    graph: Graph
    algorithms: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    mfu_causal: float | None = None
    """MFU counting half the attention scores (a causal mask's work); None for a bidirectional model."""
    builder: StepBuilder | None = None
    """What built the step (the ranks' parameters, buckets and units), for :mod:`shardwise.sim.exposure`."""

    @property
    def exposed_s(self) -> dict[str, float]:
        """Exposed communication per axis on the rank where it is largest."""
        out: dict[str, float] = {}
        for r in self.ranks:
            for axis, s in r.exposed_s.items():
                out[axis] = max(out.get(axis, 0.0), s)
        return out

    @property
    def peak_bytes(self) -> float:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def fits(self) -> bool:
        """Whether every rank's peak memory fits in the device's memory."""
        return self.peak_bytes <= self.hw.gpu.memory_bytes

    def summary(self) -> dict:
        p, t = self.cfg.parallel, self.cfg.train
        layout = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "zero": p.zero,
                  "pp_schedule": p.pp_schedule if p.pp > 1 else None, "pp_virtual": p.pp_virtual,
                  "microbatches": t.grad_accum, "micro_batch": t.micro_batch}
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "mfu_convention": MFU_CONVENTION, "mfu_causal": self.mfu_causal,
                "bubble": self.bubble, "exposed_comm_s": self.exposed_s, "peak_memory_bytes": self.peak_bytes,
                "device_memory_bytes": self.hw.gpu.memory_bytes, "fits": self.fits,
                "world": self.hw.world, "layout": layout,
                "ranks": [{"rank": r.rank, "busy_s": r.busy_s, "exposed_comm_s": r.exposed_s,
                           "peak_memory_bytes": r.peak_bytes, "states_bytes": r.states_bytes,
                           "activation_bytes": r.activation_bytes, "transient_bytes": r.transient_bytes}
                          for r in self.ranks],
                "exposed_causes": exposure.to_json(self), "algorithms": self.algorithms,
                "simulated_tasks": len(self.graph.tasks), "wall_s": self.wall_s}


def simulate(cfg: Config, hw: SimHardware, moe_imbalance: float = 1.0) -> SimResult:
    """One step of the resolved ``cfg`` on ``hw`` (``moe_imbalance``: the busiest expert rank's tokens over the
    balanced share)."""
    t0 = time.perf_counter()
    costs = RankCosts(cfg, hw, moe_imbalance)
    builder = StepBuilder(cfg, Fabric(hw), costs, moe_imbalance)
    graph = builder.build()
    step = graph.run()
    t = cfg.train
    tokens = t.global_batch * cfg.data.seq_len
    tps = tokens / step if step > 0 else float("inf")
    per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
    mfu = per_token * tps / (hw.world * hw.peak(t.precision))
    m = cfg.model
    causal = None if m.flavor == "bert" else mfu * (1 - 6.0 * m.n_layers * m.d_model * cfg.data.seq_len / per_token)
    ranks = [_rank_report(cfg, builder, costs, graph, r) for r in range(builder.pp)]
    bubble = _bubble(builder) if builder.pp > 1 else None
    return SimResult(cfg, hw, step, tps, mfu, bubble, ranks, graph, dict(builder.algorithms),
                     time.perf_counter() - t0, causal, builder)


def _bubble(builder: StepBuilder) -> float:
    """1 - busy / (p * span) over the pipeline's computations and transfers (the trainer's measure)."""
    tasks = [t for t in builder.graph.tasks if t.kind in (F, B, W) or t.stream in ("pp", "sync")]
    t0 = min(t.start for t in tasks)
    t1 = max(t.end for t in tasks if t.kind in (F, B, W) or t.name.startswith(("send", "tied")))
    busy = sum(t.duration for t in tasks if t.kind in (F, B, W))
    return 1.0 - busy / (builder.pp * (t1 - t0)) if t1 > t0 else 0.0


def _rank_report(cfg: Config, builder: StepBuilder, costs: RankCosts, graph: Graph, r: int) -> RankReport:
    tasks = graph.rank_tasks(r)
    busy = sum(b - a for a, b in busy_intervals(tasks))
    states = state_bytes(cfg, builder.params[r])
    if cfg.parallel.zero == 3 and cfg.parallel.zero_hpz > 1:  # hpZ's secondary partitions, forward to backward
        units = [u for u in builder.params[r].groups[1:] if builder.unit_axis(r, u) == "dp_cp"]  # experts keep none
        states["params"] += sum(builder.unit_bytes(r, u, padded=True) for u in units) / cfg.parallel.zero_hpz
    act, transient = _activation_peak(cfg, builder, costs, r)
    return RankReport(r, busy, exposed_comm(tasks), states, act, transient)


def _activation_peak(cfg: Config, builder: StepBuilder, costs: RankCosts, r: int) -> tuple[float, float]:
    """The most activation bytes alive at once on rank ``r`` and the transient buffers beside them."""
    p = cfg.parallel

    def chunk_bytes(stage: int) -> float:
        return sum((costs.embed() if pc == EMBED else costs.head() if pc == HEAD else costs.block(pc)).act_bytes
                   for pc in builder.pieces(stage))

    transient = 0.0
    if p.zero == 3:  # the root and two block units gathered at once (the current one and the prefetched one)
        units = builder.params[r].groups
        sizes = sorted((builder.unit_bytes(r, u, padded=True) for u in units[1:]), reverse=True)
        transient = builder.unit_bytes(r, units[0], padded=True) + sum(sizes[:2])
    if builder.pp == 1:
        return chunk_bytes(0), transient
    order = compute_order(p.pp_schedule, r, builder.pp, builder.m, builder.v)
    release = W if any(a.kind == W for a in order) else B
    sizes = {c: chunk_bytes(c * builder.pp + r) for c in range(builder.v)}
    live = peak = 0.0
    for a in order:
        if a.kind == F:
            live += sizes[a.chunk]
            peak = max(peak, live)
        elif a.kind == release:
            live -= sizes[a.chunk]
    message = costs.batch * costs.tokens * cfg.model.d_model * 4.0
    return peak, transient + 2 * message  # a received activation and a received gradient in flight


__all__ = ["SimResult", "RankReport", "load_config", "simulate", "COMPUTE", "MFU_CONVENTION"]
