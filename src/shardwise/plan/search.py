"""Layout search: enumerate dp × tp × pp × cp × ep, ZeRO stage, micro-batch and recomputation;
drop what violates divisibility or does not fit; rank the rest by predicted tokens/s.

Constraints follow Megatron-LM's (Narayanan et al. 2021 §3.3, "Takeaways"): tensor parallelism
within a node and dividing the heads; pipeline stages at most the layers (the trainer's uneven even split,
:func:`~shardwise.parallel.pipeline.checks.even_stage_sizes`: nothing has to divide); expert parallelism dividing
the experts and dp·cp (the trainer's own rule,
:func:`shardwise.parallel.expert.checks.expert_parallel_error`). ZeRO-2/3 inside a pipeline is searched too
(DeepSpeed allows only ZeRO-1 there; torchtitan composes FSDP with every schedule): its memory lines hold the stage's
unsharded gradients and, ZeRO-3, its gathered parameters until the flush (:func:`~shardwise.plan.memory.
pipeline_flush_lines`), so it wins only where the optimizer's states dominate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shardwise.parallel.expert.checks import expert_parallel_error
from shardwise.parallel.pipeline.checks import check_stages
from shardwise.plan.hardware import Cluster
from shardwise.plan.memory import (
    MemoryBreakdown,
    StateDtypes,
    activation_mode,
    exact_zero_units,
    memory_breakdown,
)
from shardwise.plan.perf import StepTime, step_time
from shardwise.plan.spec import Layout, ModelSpec
from shardwise.plan.zero_layout import ParamEntry, model_params

SEARCHED = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "recompute", "sequence_parallel")
"""Layout fields the search fills when the config leaves them open."""


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    time: StepTime

    @property
    def mem_bytes(self) -> float:
        return self.memory.total("device")


@dataclass
class SearchResult:
    ranked: list[Candidate]
    dropped: Counter = field(default_factory=Counter)
    """Reason -> number of layouts dropped for it."""
    examples: dict = field(default_factory=dict)
    """Reason -> one dropped layout (short form) as an example."""
    considered: int = 0
    fitting: int = 0
    """Layouts that passed every check and fit in memory (``ranked`` keeps the top ones)."""
    over_budget: int = 0
    """Layouts that passed every check but need more memory than the budget."""
    smallest_over_budget: Candidate | None = None
    """Of those, the one needing the least memory (with ``over_budget == 1``: the only layout the
    config leaves, shown in full so that the user sees what to change)."""
    budget_bytes: float = 0.0
    """Device bytes a layout may use: ``memory_fraction`` of the GPU's memory."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(m: ModelSpec, lay: Layout, s: int, cluster: Cluster, states: StateDtypes, precision: str,
             attention: str = "flash", bucket_mb: float = 25.0, zero_unit: int = 1,
             params: list[ParamEntry] | None = None, zero_hpz: int = 1) -> Candidate:
    """Memory and time of one layout (no checks); ``params`` and ``zero_hpz`` as for :func:`memory_breakdown`."""
    act_bytes = 4 if precision == "fp32" else 2
    mem = memory_breakdown(m, lay, s, states, attention, activation_mode(precision, states), bucket_mb, zero_unit,
                           params, zero_hpz)
    units = exact_zero_units(m, lay, bucket_mb, zero_unit, params, zero_hpz) if params is not None else None
    return Candidate(lay, mem, step_time(m, lay, s, cluster, states, precision, act_bytes, units))


def check(m: ModelSpec, lay: Layout, s: int, cluster: Cluster) -> str | None:
    """Why ``lay`` cannot run ``m`` on ``cluster`` (None if it can, memory aside)."""
    if lay.world != cluster.world:
        return f"dp·tp·pp·cp != {cluster.world} GPUs"
    if m.n_heads % lay.tp or m.n_kv_heads % lay.tp:
        return "tp does not divide the (key/value) heads"
    if lay.tp > cluster.gpus_per_node:
        return "tp larger than a node"
    if m.d_ff % lay.tp:
        return "tp does not divide d_ff"
    try:  # the trainer's rule: every stage a block (or the embedding's / head's slot); nothing has to divide
        check_stages(m.n_layers, lay.pp * lay.pp_virtual, int(lay.pp_embedding_slot) + int(lay.pp_head_slot))
    except ValueError:
        return "more pipeline stages (pp·pp_virtual) than layers and slots"
    if s % lay.cp or (lay.cp > 1 and (s // lay.cp) % 2):
        return "cp does not divide the sequence (in even chunks)"
    if expert_parallel_error(lay.dp, lay.cp, lay.ep, m.n_experts):  # the trainer's own rule
        return "ep does not divide dp·cp and the experts"
    if lay.sequence_parallel and lay.tp == 1:
        return "sequence parallel without tensor parallel"
    if lay.offload != "none" and lay.zero == 0:
        return "offload needs ZeRO >= 1"
    if lay.pp_virtual > 1 and lay.grad_accum % lay.pp:
        return "interleaving needs micro-batches divisible by pp"
    return None


def search(m: ModelSpec, s: int, cluster: Cluster, fixed: dict, global_batch: int | None, states: StateDtypes,
           precision: str = "bf16", attention: str = "flash", memory_fraction: float = 0.9, top: int = 10,
           bucket_mb: float = 25.0, max_micro_batch: int = 64, zero_unit: int = 1,
           zero_hpz: int = 1) -> SearchResult:
    """Every layout agreeing with ``fixed`` (Layout field -> value), ranked by tokens/s.

    ``global_batch`` None means micro_batch·grad_accum·dp from ``fixed``. A layout fits when its
    device bytes are at most ``memory_fraction`` of the GPU's memory (the rest is the framework,
    allocator fragmentation and kernels' workspace). ``zero_hpz`` (``parallel.zero_hpz``) adds ZeRO++
    hpZ's secondary partitions to the ZeRO-3 layouts whose dp·cp it divides."""
    world = cluster.world

    def opts(name, default):
        return [fixed[name]] if name in fixed else default

    budget = cluster.gpu.memory_bytes * memory_fraction
    result = SearchResult(ranked=[], budget_bytes=budget)
    ranked: list[Candidate] = []
    params = None if m.n_experts else model_params(m)  # for the ZeRO engine's exact units, built once

    def drop(reason, lay):
        result.dropped[reason] += 1
        result.examples.setdefault(reason, lay.short())

    for tp in opts("tp", [d for d in _divisors(world) if d <= cluster.gpus_per_node]):
        for pp in opts("pp", [d for d in _divisors(world // tp) if d <= m.n_layers] if world % tp == 0 else [1]):
            for cp in opts("cp", [d for d in _divisors(max(1, world // (tp * pp))) if d <= 16]):
                dps = opts("dp", [world // (tp * pp * cp)] if world % (tp * pp * cp) == 0 else [])
                for dp in dps:
                    if global_batch is not None and global_batch % dp:
                        result.considered += 1
                        drop("global batch not divisible by dp", Layout(dp=dp, tp=tp, pp=pp, cp=cp))
                        continue
                    per_dp = global_batch // dp if global_batch is not None else None
                    if per_dp is None:
                        mbs = [fixed.get("micro_batch", 1)]
                    else:
                        mbs = opts("micro_batch", [d for d in _divisors(per_dp) if d <= max_micro_batch])
                    eps = opts("ep", [d for d in _divisors(dp * cp) if not expert_parallel_error(dp, cp, d,
                                                                                                 m.n_experts)])
                    for ep in eps:
                        for zero in opts("zero", [0, 1, 2, 3]):
                            for mb in mbs:
                                if per_dp is not None and per_dp % mb:
                                    result.considered += 1
                                    drop("global batch not divisible by dp·micro_batch", Layout(dp=dp, micro_batch=mb))
                                    continue
                                ga = per_dp // mb if per_dp is not None else fixed.get("grad_accum", 1)
                                for rc in opts("recompute", ["none", "selective", "full"]):
                                    for sp in opts("sequence_parallel", [False, True] if tp > 1 else [False]):
                                        lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                                                     offload=fixed.get("offload", "none"), micro_batch=mb,
                                                     grad_accum=ga, recompute=rc, sequence_parallel=sp,
                                                     pp_virtual=fixed.get("pp_virtual", 1),
                                                     pp_embedding_slot=fixed.get("pp_embedding_slot", False),
                                                     pp_head_slot=fixed.get("pp_head_slot", False))
                                        result.considered += 1
                                        why = check(m, lay, s, cluster)
                                        if why:
                                            drop(why, lay)
                                            continue
                                        cand = evaluate(m, lay, s, cluster, states, precision, attention, bucket_mb,
                                                        zero_unit, params, zero_hpz)
                                        if cand.mem_bytes > budget:
                                            drop(f"does not fit in {memory_fraction:.0%} of "
                                                 f"{cluster.gpu.memory_bytes / 1e9:.0f} GB", lay)
                                            result.over_budget += 1
                                            least = result.smallest_over_budget
                                            if least is None or cand.mem_bytes < least.mem_bytes:
                                                result.smallest_over_budget = cand
                                            continue
                                        ranked.append(cand)
    ranked.sort(key=lambda c: (-c.time.tokens_per_s, c.time.comm_sent_bytes, c.mem_bytes))
    result.ranked = ranked[:top] if top else ranked
    result.fitting = len(ranked)
    return result
