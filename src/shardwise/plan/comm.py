"""Communication per step: volume for each technique and its time under the alpha-beta model.

Collective costs come from the one alpha-beta model of the collective algorithms,
:func:`shardwise.dist.comm.cost.cost` (Hockney 1994; Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH", §4; Chan et al. 2007): an
algorithm's ``Cost(steps, bytes, ..., sent)`` on p ranks takes ``steps·α + bytes/β`` seconds.
The planner uses the bandwidth-optimal ones, for n bytes:
  ring all-reduce                  2(p−1)·α + 2(p−1)/p · n/β
  ring all-gather / reduce-scatter (p−1)·α + (p−1)/p · n/β     (n = the full, gathered size)
  pairwise all-to-all              (p−1)·α + (p−1)/p · n/β     (n = one rank's send buffer)
  point-to-point                   α + n/β                       (here: cost.py has no send/recv)
On a two-level network a group that spans nodes also gets the hierarchical algorithm
(reduce-scatter inside the node, all-reduce of n/g across nodes, all-gather inside the node;
e.g. Jia et al. 2018, "Highly Scalable Deep Learning Training System with Mixed-Precision", §4.2),
built here from the same per-algorithm costs with intra- and inter-node α, β, and the cheaper of
flat ring and hierarchical is used. Flows that cross at once share the node's link (max-rate model,
Gropp, Olson & Samfass 2016). On gloo (``Cluster.backend``) ZeRO's collectives are the trainer's
pairwise exchanges (all blocks posted at once), timed as such.

Volumes per technique (per rank and step, ``payload`` = bytes handed to the collective, the
trainer's ``comm_bytes``): data parallel all-reduces the gradients once per step; ZeRO-1/2
reduce-scatter gradients and all-gather weights (same volume, ZeRO §7.2); ZeRO-3 all-gathers the
weights in forward and backward and reduce-scatters gradients every micro-batch (1.5×, §7.2.2); inside a
pipeline it gathers each stage's weights once per step and keeps them to the flush, after which it
reduce-scatters the accumulated gradients once (1×, as ZeRO-1/2; what torchtitan's FSDP does in a pipeline);
tensor parallel all-reduces b·s·h activations twice in forward and twice in backward per layer
(Shoeybi et al. 2019 §3), or all-gathers and reduce-scatters them with sequence parallelism
(Korthikanti et al. 2022 §4.2.2, same volume); pipeline stages send b·s·h activations forward
and gradients back per micro-batch (Narayanan et al. 2021 §4.1, scatter/gather /t); context
parallelism passes K and V around a ring (Liu et al. 2023, "Ring Attention"); expert parallelism
exchanges tokens with two all-to-alls in forward and two in backward per MoE layer (Lepikhin et
al. 2020, "GShard" §2.3).

ZeRO++ hpZ (Wang et al. 2023 §3.2) moves ZeRO-3's backward gathers inside a node of h ranks and
leaves their size alone: each hands over the full unit buffer, so ``comm_bytes`` is the same with and
without it, while a rank sends (h-1)/h of the buffer per backward gather instead of (N-1)/N.

The pipeline item above is the busiest (middle) rank's volume in the planner's activation dtype,
for the time model. What shardwise's trainer *measures* (``pp_sent_bytes``, on global rank 0) is
:func:`pipeline_sent_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.dist.comm.cost import Cost, cost
from shardwise.plan.hardware import Cluster
from shardwise.plan.memory import StateDtypes, params_per_rank
from shardwise.plan.spec import Layout, ModelSpec
from shardwise.plan.tensors import stage_blocks
from shardwise.plan.zero_layout import ZeroUnits

AXIS_STRIDE_ORDER = ("tp", "cp", "dp", "pp")
"""Rank order of shardwise's mesh (shardwise.dist.mesh): tp innermost, then cp, dp, pp."""


@dataclass
class CommItem:
    technique: str
    collective: str
    group: int
    payload: float
    """Bytes handed to one collective call."""
    calls: int
    time_s: float
    """Time of all ``calls``."""
    overlap: str
    """What it can hide behind: "backward", "compute", "attention" or "none"."""
    collectives: int = 0
    """Collective calls the trainer issues for it (ZeRO: one per unit and pass); 0: ``calls``."""

    @property
    def n_collectives(self) -> int:
        return self.collectives or self.calls

    @property
    def total_payload(self) -> float:
        return self.payload * self.calls

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends for all calls (``Cost.sent`` of the algorithm)."""
        return collective_cost(self.collective, self.group, self.payload).sent * self.calls


ALGORITHM = {"all-reduce": ("all_reduce", "ring"), "all-gather": ("all_gather", "ring"),
             "reduce-scatter": ("reduce_scatter", "ring"), "all-to-all": ("all_to_all", "pairwise")}
"""The planner's collectives -> (collective, algorithm) of :func:`shardwise.dist.comm.cost.cost`."""


def collective_cost(collective: str, p: int, n: float) -> Cost:
    """Steps, bytes on the critical path and bytes sent per rank of one call on ``p`` ranks.

    Point-to-point (``"send/recv"``: one message of n bytes, Hockney 1994) is the one the
    collective cost model lacks, so it is written here."""
    if collective == "send/recv":
        return Cost(1, n, 0.0, n) if p > 1 and n > 0 else Cost(0, 0, 0, 0)
    if collective not in ALGORITHM:
        raise ValueError(f"no cost formula for {collective!r}; use one of {', '.join(ALGORITHM)} or send/recv")
    name, algorithm = ALGORITHM[collective]
    return cost(name, algorithm, n, p)


def _flat(collective: str, p: int, n: float, alpha: float, beta: float) -> float:
    """Seconds of one call on a flat network of latency ``alpha`` and bandwidth ``beta`` (bytes/s)."""
    if p <= 1 or n <= 0:
        return 0.0
    c = collective_cost(collective, p, n)
    return c.steps * alpha + c.bytes / beta


def collective_time(collective: str, p: int, n: float, stride: int, cluster: Cluster,
                    algorithm: str = "ring") -> float:
    """Alpha-beta time of one collective over a group of ``p`` ranks spaced ``stride`` apart.

    Between nodes, k flows of one node at once each get ``min(inter_bw, node_bw / k)`` (the max-rate
    model of Gropp, Olson & Samfass 2016, §3): a flat ring sends one flow per node across, the
    inter-node phase of the hierarchical form one per rank of the node. ``algorithm="pairwise"``: every
    rank sends its 1/p block to every other at once (ZeRO's exchanges on gloo, Thakur et al. 2005 §4):
    the slower of the blocks within the node and those crossing, limited by the node's link."""
    if p <= 1 or n <= 0:
        return 0.0
    g = cluster.gpu
    gpn = cluster.gpus_per_node
    local = 1 if stride >= gpn else max(1, min(p, gpn // stride))
    nodes = -(-p // local)
    one_flow = min(g.inter_bw, cluster.node_bw)
    every_flow = min(g.inter_bw, cluster.node_bw / local)
    if algorithm == "pairwise":
        inside = (local - 1) * (g.intra_latency + n / p / g.intra_bw)
        across = (p - local) * (g.inter_latency + n / p / every_flow) if nodes > 1 else 0.0
        return max(inside, across)
    if nodes == 1:
        return _flat(collective, p, n, g.intra_latency, g.intra_bw)
    flat = _flat(collective, p, n, g.inter_latency, one_flow)
    if local == 1:
        return flat
    if collective == "all-to-all":
        on_node = n * (local - 1) / p / g.intra_bw
        off_node = n * (p - local) / p / every_flow
        return (p - 1) * g.inter_latency + max(on_node, off_node)
    if collective == "all-reduce":
        hier = (_flat("reduce-scatter", local, n, g.intra_latency, g.intra_bw)
                + _flat("all-reduce", nodes, n / local, g.inter_latency, every_flow)
                + _flat("all-gather", local, n, g.intra_latency, g.intra_bw))
    else:
        hier = (_flat(collective, local, n, g.intra_latency, g.intra_bw)
                + _flat(collective, nodes, n / local, g.inter_latency, every_flow))
    return min(flat, hier)


FP32_BYTES = 4


def strides(lay: Layout) -> dict[str, int]:
    """Distance between neighbouring ranks of each axis in shardwise's mesh order."""
    return {"tp": 1, "cp": lay.tp, "ep": lay.tp, "dp": lay.tp * lay.cp, "pp": lay.tp * lay.cp * lay.dp}


def comm_items(m: ModelSpec, lay: Layout, s: int, states: StateDtypes, cluster: Cluster,
               act_bytes: int = 2, units: ZeroUnits | None = None, dp_flags: int = 0,
               ep_flags: int = 0) -> list[CommItem]:
    """Every collective of one step on the busiest rank, with its volume and time.

    With ``units`` (the ZeRO engine's flat units, :func:`shardwise.plan.memory.exact_zero_units`)
    the ZeRO payloads are the engine's: padded units; ZeRO-3's root unit gathered once per
    micro-batch (it stays gathered from forward to the end of backward), the blocks twice; and
    gradients reduce-scattered once per step (micro-batches accumulate under ``no_sync``); and one
    uint8 flag per parameter tensor all-reduced once per step (which parameters had a gradient).
    ``dp_flags``: without ZeRO, the trainer's DataParallel carries one such flag per parameter tensor
    inside its gradient buckets, in the gradient dtype (pass the tensor count to predict its bytes
    exactly; 0 leaves them out, as a planner may); ``ep_flags``: the same for the expert tensors, whose
    buckets are reduced over the expert replicas. With ZeRO-1/2 and no ``units`` (a mixture-of-experts
    model, whose expert units are sliced over their own replicas), ``dp_flags`` is the engine's uint8 flag
    all-reduce over the whole data-parallel group.

    Tensor parallelism: two regions per block (attention and MLP, Shoeybi et al. 2019 §3), one where the
    MLP is a MoE block (whole on every tp rank; with sequence parallelism it routes this rank's tokens).

    Expert parallelism: each MoE block's tokens go out and back by all-to-all in forward and again
    in backward (4 per block and micro-batch, ``micro_batch * s * top_k`` rows of ``d_model``, dropless;
    GShard, Lepikhin et al. 2021 §3.2; ``s / cp``, and ``s / (cp * tp)`` with sequence parallelism), plus one
    exchange of the ``n_experts`` split sizes (int64) per block and forward (:func:`expert_count_bytes`).
    Where one sequence's tokens are spread over ranks, the router's losses add up per block and forward:
    the routed counts (int64) over tp with sequence parallelism and over cp, and the probability and z sums
    (``n_experts + 1`` fp32) over tp (:mod:`shardwise.parallel.expert.sequence`)."""
    st = strides(lay)
    items: list[CommItem] = []

    zero_algorithm = "pairwise" if cluster.backend == "gloo" else "ring"  # ZeRO's exchanges on gloo

    def add(tech, coll, p, n, calls, stride, overlap, algorithm="ring", collectives=0):
        if p > 1 and n > 0 and calls > 0:
            seconds = calls * collective_time(coll, p, n, stride, cluster, algorithm)
            items.append(CommItem(tech, coll, p, n, calls, seconds, overlap, collectives))

    dense, expert = params_per_rank(m, lay)
    b = states.bytes()
    mb = lay.grad_accum
    shard = lay.dp * lay.cp
    for kind, psi, group in (("dense", dense, shard), ("expert", expert, max(1, shard // lay.ep))):
        label = "data parallel" if kind == "dense" else "expert data parallel"
        if units is not None and kind == "dense" and lay.zero in (1, 2):
            psi = units.psi_padded
        stride = st["cp"] if lay.cp > 1 else st["dp"]
        if units is not None and kind == "dense":
            add("ZeRO grad flags", "all-reduce", group, units.n_tensors, 1, stride, "none")
        elif lay.zero in (1, 2) and kind == "dense":
            add("ZeRO grad flags", "all-reduce", group, dp_flags, 1, stride, "none")
        if lay.zero == 0:
            flags = dp_flags if kind == "dense" else ep_flags
            add(label, "all-reduce", group, (psi + flags) * b["grads"], 1, stride, "backward")
        elif lay.zero in (1, 2):
            add(f"ZeRO-{lay.zero} grads", "reduce-scatter", group, psi * b["grads"], 1, stride, "backward",
                zero_algorithm)
            add(f"ZeRO-{lay.zero} weights", "all-gather", group, psi * b["params"], 1, stride, "none", zero_algorithm)
        elif lay.pp > 1:  # a stage's units stay gathered from the first forward to the flush: once a step
            n_units = len(units.numels) if units is not None and kind == "dense" else 0
            psi = units.psi_padded if units is not None and kind == "dense" else psi
            add("ZeRO-3 weights (kept over the step)", "all-gather", group, psi * b["params"], 1, stride, "compute",
                zero_algorithm, n_units)
            add("ZeRO-3 grads (after the flush)", "reduce-scatter", group, psi * b["grads"], 1, stride, "none",
                zero_algorithm, n_units)
        elif units is not None and kind == "dense":
            root = sum(units.padded_numels[:units.root_units])
            n_units, blocks = len(units.numels), len(units.numels) - units.root_units  # one collective per unit
            add("ZeRO-3 root weights (fwd)", "all-gather", group, root * b["params"], mb, stride, "compute",
                zero_algorithm, mb * units.root_units)
            block_bytes = (units.psi_padded - root) * b["params"]
            if units.hpz > 1:  # hpZ: the backward gathers run inside each node of h ranks
                add("ZeRO-3 block weights (fwd)", "all-gather", group, block_bytes, mb, stride, "compute",
                    zero_algorithm, mb * blocks)
                add("ZeRO-3 block weights (bwd, hpZ node)", "all-gather", units.hpz, block_bytes, mb, stride,
                    "compute", zero_algorithm, mb * blocks)
            else:
                add("ZeRO-3 block weights (fwd+bwd)", "all-gather", group, block_bytes, 2 * mb, stride, "compute",
                    zero_algorithm, 2 * mb * blocks)
            add("ZeRO-3 grads", "reduce-scatter", group, units.psi_padded * b["grads"], 1, stride, "backward",
                zero_algorithm, n_units)
        else:
            add("ZeRO-3 weights (fwd+bwd)", "all-gather", group, psi * b["params"], 2 * mb, stride, "compute",
                zero_algorithm)
            add("ZeRO-3 grads", "reduce-scatter", group, psi * b["grads"], mb, stride, "backward", zero_algorithm)
    s_local = s // lay.cp
    act = lay.micro_batch * s_local * m.d_model * act_bytes
    layers = stage_blocks(m, lay)  # the busiest pipeline rank's blocks (the trainer's even split)
    moe_layers = m.moe_blocks * layers // m.n_layers
    fwd_passes = 2 if lay.recompute == "full" else 1
    if lay.tp > 1:
        per_pass = (2 * layers - moe_layers) * mb  # attention and dense MLPs; a MoE block is whole on every tp rank
        if lay.sequence_parallel:
            add("tensor parallel (SP)", "all-gather", lay.tp, act, per_pass * (fwd_passes + 1), st["tp"], "none")
            add("tensor parallel (SP)", "reduce-scatter", lay.tp, act, per_pass * (fwd_passes + 1), st["tp"], "none")
        else:
            add("tensor parallel", "all-reduce", lay.tp, act, per_pass * (fwd_passes + 1), st["tp"], "none")
    if lay.pp > 1:
        boundary = act / (lay.tp if lay.sequence_parallel or lay.tp > 1 else 1)
        add("pipeline", "send/recv", 2, boundary, 2 * mb * lay.pp_virtual, st["pp"], "none")
    if lay.cp > 1:
        kv = 2 * lay.micro_batch * s_local * m.kv_dim // lay.tp * act_bytes
        # forward: K,V around the ring; backward: K,V again plus their gradients
        add("context parallel", "all-gather", lay.cp, kv * lay.cp, 3 * layers * mb, st["cp"], "attention")
    if m.n_experts and lay.ep > 1:
        routed = s_local // (lay.tp if lay.sequence_parallel else 1)  # sequence parallel: this rank's 1/tp
        tokens = lay.micro_batch * routed * m.moe_top_k * m.d_model * act_bytes
        add("expert parallel", "all-to-all", lay.ep, tokens, 2 * (fwd_passes + 1) * moe_layers * mb, st["ep"],
            "none")
        add("expert parallel (counts)", "all-to-all", lay.ep, expert_count_bytes(m), fwd_passes * moe_layers * mb,
            st["ep"], "none")
    if m.n_experts and lay.etp > 1:  # each expert split over tp (shardwise.parallel.expert.tensor)
        rows = lay.micro_batch * s_local * m.moe_top_k * m.d_model * act_bytes  # routed rows, balanced routing
        passes = (fwd_passes + 1) * moe_layers * mb
        if lay.sequence_parallel:  # every tp rank's rows gathered in, the partial outputs reduce-scattered back
            add("tensor parallel (experts, SP)", "all-gather", lay.tp, rows, passes, st["tp"], "none")
            add("tensor parallel (experts, SP)", "reduce-scatter", lay.tp, rows, passes, st["tp"], "none")
            add("tensor parallel (experts, counts)", "all-gather", lay.tp, lay.tp * expert_count_bytes(m),
                fwd_passes * moe_layers * mb, st["tp"], "none")
        else:  # Megatron's f and g around the experts
            add("tensor parallel (experts)", "all-reduce", lay.tp, rows, passes, st["tp"], "none")
    if m.n_experts:  # the router's losses over a sequence spread over ranks (shardwise.parallel.expert.sequence)
        calls = fwd_passes * moe_layers * mb
        if lay.sequence_parallel and lay.tp > 1:
            add("expert parallel (router counts, sp)", "all-reduce", lay.tp, expert_count_bytes(m), calls, st["tp"],
                "none")
            add("expert parallel (router sums, sp)", "all-reduce", lay.tp, FP32_BYTES * (m.n_experts + 1), calls,
                st["tp"], "none")
        add("expert parallel (router counts, cp)", "all-reduce", lay.cp, expert_count_bytes(m), calls, st["cp"], "none")
    return items


def expert_count_bytes(m: ModelSpec) -> int:
    """The split sizes a MoE block exchanges before its tokens: one int64 per expert."""
    return 8 * m.n_experts


def pipeline_sent_bytes(m: ModelSpec, lay: Layout, s: int, act_bytes: int = FP32_BYTES,
                        grad_bytes: int = FP32_BYTES) -> float:
    """Bytes global rank 0 (pipeline rank 0) sends point-to-point in one step: the trainer's
    ``pp_sent_bytes`` (shardwise.parallel.pipeline.executor ``Pipeline.sent_bytes``).

    Rank 0 holds stages c·p for chunks c = 0..v−1 (Narayanan et al. 2021 §2.2.2). Per micro-batch
    each of them that is not the last stage sends its output activation forward (all v when p > 1),
    and each that is not stage 0 sends its input's gradient back (v − 1): (2v − 1)·m messages of
    [micro_batch, s / cp, d_model] -- [micro_batch, s / (cp·tp), d_model] with sequence parallelism, whose
    residual stream between blocks is split along the sequence (Korthikanti et al. 2022 §4.2.2). They
    travel in **fp32** (``act_bytes``) whatever ``train.precision`` is: the trainer's residual stream
    stays fp32 under ``torch.autocast``, and the executor sends in its ``act_dtype`` (fp32). With tied
    embeddings (GPT-2 flavour) stage 0 and the last stage add their copies' gradients once per step (Press &
    Wolf 2017; the tied copies of Megatron-LM, Narayanan et al. 2021 §3): rank 0 sends its vocabulary rows'
    gradient, ceil(vocab / tp)·d_model elements (``grad_bytes``; the table is split over the tensor-parallel
    ranks, padded to equal pieces)."""
    p, v, mb = lay.pp, lay.pp_virtual, lay.grad_accum
    if p <= 1:
        return 0.0
    tokens = s // lay.cp // (lay.tp if lay.sequence_parallel else 1)  # sequence parallel: this rank's 1/tp
    message = lay.micro_batch * tokens * m.d_model * act_bytes
    tied = -(-m.vocab_size // lay.tp) * m.d_model * grad_bytes if m.tie_embeddings else 0  # this rank's vocab rows
    return float((2 * v - 1) * mb * message + tied)
