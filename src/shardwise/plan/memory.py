"""Memory per device, by category, each line with its formula and source.

Categories use the names a memory accountant in the trainer reports (``MEMORY_METRICS``), so
``shardwise plan --compare`` can set measured beside predicted.

Model states (Rajbhandari et al. 2019, "ZeRO", §3.1 and §5): with Ψ parameters on a rank and
N_d data-parallel ranks, mixed-precision Adam keeps 2Ψ fp16 weights, 2Ψ fp16 gradients and
KΨ = 12Ψ optimizer states (fp32 master weights, momentum, variance). ZeRO-1 shards the optimizer
states over N_d, ZeRO-2 also the gradients, ZeRO-3 also the weights (§5.1–5.3, Fig. 1).
Offload moves the sharded gradients, master weights and optimizer states to host memory
(ZeRO-Offload, Ren et al. 2021, §4) or NVMe (ZeRO-Infinity, Rajbhandari et al. 2021, §5).
For layouts shardwise's ZeRO engine runs, the lines use its exact flat units, each padded to a
multiple of N_d (:mod:`shardwise.plan.zero_layout`); the paper's unpadded Ψ/N_d stays beside them.
Inside a pipeline ZeRO-2/3 also hold the stage's unsharded gradients and (ZeRO-3) gathered parameters
until the flush (:func:`pipeline_flush_lines`).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4, Table 2): per layer, with s tokens, micro-batch b, hidden h, a heads, t-way tensor
parallelism, 16-bit activations and dropout:
  no parallelism           sbh(34 + 5as/h)
  tensor parallel          sbh(10 + 24/t + 5as/(ht))
  + sequence parallel      sbh/t·(34 + 5as/h)
  + selective recompute    sbh(10 + 24/t)           (tensor parallel)
  + SP + selective         sbh·34/t
  full recomputation       2sbh                     (only the block input is kept)
The first pipeline stage of 1F1B keeps p micro-batches in flight, L layers in all (§4.2.3);
interleaving with v stages per rank multiplies that by (1 + (p−1)/(p·v)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.plan.params import (
    attention_params,
    block_norms,
    block_params,
    mlp_params,
    norm_params,
    shared_params,
)
from shardwise.plan.spec import Layout, ModelSpec
from shardwise.plan.tensors import rank_blocks, stage_blocks
from shardwise.plan.zero_layout import (
    ParamEntry,
    ZeroUnits,
    engine_state_bytes,
    first_rank_params,
    model_params,
    zero_units,
)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

MODEL_STATE_METRICS = ("mem_params_bytes", "mem_grads_bytes", "mem_master_bytes", "mem_optimizer_bytes")
MEMORY_METRICS = ("mem_params_bytes", "mem_grads_bytes", "mem_master_bytes", "mem_optimizer_bytes",
                  "mem_activations_bytes", "mem_buffers_bytes")
"""Per-rank memory categories, under the names the trainer's metrics use: the memory accountant
(shardwise.train.memory) logs ``mem_{params,grads,master,optimizer}_bytes`` and their sum
``mem_total_bytes``; activations and buffers are predicted only, for now."""

FLUSH_METRICS = ("mem_gathered_bytes", "mem_grad_accum_bytes")
"""What a ZeRO-2/3 pipeline step holds until its flush beyond the sharded model state (device lines, so in
the device total; the accountant measures them at the flush): ZeRO-3's gathered stage and the gradients
accumulated unsharded over the micro-batches (:func:`pipeline_flush_lines`)."""


@dataclass(frozen=True)
class StateDtypes:
    """The dtype of each model state; ``master=None`` when the weights themselves are fp32."""

    weights: str = "fp32"
    grads: str = "fp32"
    master: str | None = None
    momentum: str = "fp32"
    variance: str = "fp32"

    def bytes(self) -> dict[str, int]:
        return {"params": DTYPE_BYTES[self.weights], "grads": DTYPE_BYTES[self.grads],
                "master": DTYPE_BYTES[self.master] if self.master else 0,
                "optimizer": DTYPE_BYTES[self.momentum] + DTYPE_BYTES[self.variance]}

    @property
    def per_param(self) -> int:
        """Bytes per parameter before activations (e.g. 16 for fp32 Adam, 16 for mixed precision)."""
        return sum(self.bytes().values())


STATE_CONVENTIONS = {
    "fp32": StateDtypes(),
    "shardwise": StateDtypes(),
    "fp32+master": StateDtypes(master="fp32"),
    "mixed": StateDtypes(weights="bf16", grads="bf16", master="fp32"),
    "mixed-fp16": StateDtypes(weights="fp16", grads="fp16", master="fp32"),
    "bf16-states": StateDtypes(weights="fp32", grads="bf16", momentum="bf16", variance="fp32"),
}
"""Named conventions. "shardwise" is what our trainer does for every ``train.precision``: fp32
weights (autocast casts on the fly), fp32 gradients, fp32 Adam moments. "mixed" is Micikevicius et
al. 2018 / ZeRO §3.1 (K = 12). "bf16-states" is fp32 weights, bf16 gradients and momentum, fp32
variance: 12 bytes per parameter. "fp32+master" counts a third fp32 copy of the weights with the
optimizer, as some course notes do (GPT-2 1.5B: 18 GB of optimizer state instead of 12)."""


def state_bytes_by_tensor(psi: float, states: StateDtypes) -> dict[str, float]:
    """Bytes of each model-state tensor for ``psi`` parameters, named with their dtype
    (e.g. GPT-3 175B mixed precision: 350 GB fp16 weights, 700 GB fp32 momentum)."""
    out = {f"weights ({states.weights})": psi * DTYPE_BYTES[states.weights],
           f"grads ({states.grads})": psi * DTYPE_BYTES[states.grads]}
    if states.master:
        out[f"master ({states.master})"] = psi * DTYPE_BYTES[states.master]
    out[f"momentum ({states.momentum})"] = psi * DTYPE_BYTES[states.momentum]
    out[f"variance ({states.variance})"] = psi * DTYPE_BYTES[states.variance]
    return out


def parse_state_dtypes(text: str) -> StateDtypes:
    """A convention name, or ``weights=bf16,grads=bf16,master=fp32,momentum=fp32,variance=fp32``."""
    if text in STATE_CONVENTIONS:
        return STATE_CONVENTIONS[text]
    kw: dict = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in ("weights", "grads", "master", "momentum", "variance"):
            raise ValueError(f"--states: unknown state {key!r}; use a convention ({', '.join(STATE_CONVENTIONS)}) "
                             "or weights=..,grads=..,master=..,momentum=..,variance=..")
        if value in ("none", "") and key == "master":
            kw[key] = None
        elif value in DTYPE_BYTES:
            kw[key] = value
        else:
            raise ValueError(f"--states: {key}={value!r}; use one of {', '.join(DTYPE_BYTES)}")
    return StateDtypes(**kw)


@dataclass
class MemoryLine:
    name: str
    bytes: float
    formula: str
    source: str
    where: str = "device"
    paper_bytes: float | None = None
    """For model states: the paper's unpadded Ψ/N_d value (``bytes`` may differ: the engine's padded units)."""


@dataclass
class MemoryBreakdown:
    lines: list[MemoryLine] = field(default_factory=list)

    def add(self, name, value, formula, source, where="device", paper_bytes=None):
        self.lines.append(MemoryLine(name, float(value), formula, source, where,
                                     None if paper_bytes is None else float(paper_bytes)))

    def total(self, where: str = "device") -> float:
        return sum(line.bytes for line in self.lines if line.where == where)

    def by_metric(self, where: str = "device") -> dict[str, float]:
        out = {k: 0.0 for k in MEMORY_METRICS}
        for line in self.lines:
            if line.where == where:
                out[line.name] = out.get(line.name, 0.0) + line.bytes
        return out


# ---- model states ---------------------------------------------------------------------------


def zero_model_states(psi: float, dp: int, stage: int, states: StateDtypes) -> dict[str, float]:
    """Bytes per rank of parameters, gradients, master weights and optimizer states for ZeRO
    ``stage`` 0–3 over ``dp`` ranks (Rajbhandari et al. 2019, §5, Fig. 1)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage}; use 0, 1, 2 or 3")
    b = states.bytes()
    return {
        "params": psi * b["params"] / (dp if stage >= 3 else 1),
        "grads": psi * b["grads"] / (dp if stage >= 2 else 1),
        "master": psi * b["master"] / (dp if stage >= 1 else 1),
        "optimizer": psi * b["optimizer"] / (dp if stage >= 1 else 1),
    }


def params_per_rank(m: ModelSpec, lay: Layout) -> tuple[float, float]:
    """(dense, expert) parameters held by the busiest pipeline stage of one rank.

    Matrices and embeddings are split over ``tp`` (Megatron column/row/vocab-parallel layers,
    Shoeybi et al. 2019 §3); norms and row-parallel biases are replicated. Experts are split over
    ``ep`` and whole on every tp rank, as the trainer keeps them, or with ``etp`` their hidden units over tp too
    (the second projection's bias whole). The first stage holds the token (and
    position) embedding; the last the final norm and the head (and, tied with pp > 1, a copy of the
    embedding, as Megatron does, §3 of Narayanan et al. 2021)."""
    t, h = lay.tp, m.d_model
    norm = norm_params(m)
    attn_rep = h if m.flavor in ("gpt2", "bert") else 0  # o_proj bias is replicated
    if m.kv_lora_rank:  # latent attention's down-projections and their norms are whole on every tp rank
        r_q = m.q_lora_rank
        attn_rep += (h * r_q + r_q if r_q else 0) + h * (m.kv_lora_rank + m.rope_dim) + m.kv_lora_rank
    attn = (attention_params(m) - attn_rep) / t + attn_rep
    dense_mlp_bias_rep = h if m.flavor in ("gpt2", "bert") else 0
    mlp = (mlp_params(m) - dense_mlp_bias_rep) / t + dense_mlp_bias_rep
    # an MoE block (router, experts, shared experts) stays whole on every tp rank (shardwise.parallel.tensor.plan);
    # its experts split over ep, and with etp each expert's hidden units over tp (shardwise.parallel.expert.tensor)
    moe_share = m.moe_blocks / m.n_layers  # MoE blocks per block
    out_bias = h if m.flavor in ("gpt2", "bert") else 0
    expert = (mlp_params(m, m.expert_d_ff) - out_bias) / lay.etp + out_bias
    experts = moe_share * m.n_experts * expert / lay.ep
    shared = shared_params(m)
    norms = block_norms(m)  # whole on every tp rank, but for a QK-norm over the whole projections (split)
    if m.qk_norm and m.qk_norm_scope == "projection":
        norms -= (m.q_dim + m.kv_dim) * (1 - 1 / t)
    dense_block = attn + norms + (1 - moe_share) * mlp + moe_share * (h * m.n_experts + shared)
    rows = -(-m.vocab_size // t)  # vocabulary-parallel tables are padded to equal pieces
    emb = rows * h + (m.max_seq_len * h if m.flavor in ("gpt2", "bert") else 0)
    head = rows * h
    first = emb + (0 if lay.pp > 1 else norm + (0 if m.tie_embeddings else head))
    last = norm + (head if (lay.pp > 1 or not m.tie_embeddings) else 0)
    if lay.pp == 1:
        return m.n_layers * dense_block + first, m.n_layers * experts
    last_rank = (lay.pp * lay.pp_virtual - 1) % lay.pp
    ranks = [(rank_blocks(m, lay, r), first * (r == 0) + last * (r == last_rank)) for r in range(lay.pp)]
    blocks, extra = max(ranks, key=lambda b: b[0] * dense_block + b[1])  # the busiest pipeline rank
    return blocks * dense_block + extra, blocks * experts


def hpz_of(lay: Layout, zero_hpz: int = 1) -> int:
    """The hpZ size ``parallel.zero_hpz`` where it applies to ``lay`` (ZeRO-3, h dividing N_d = dp·cp),
    else 1: a search holding ``zero_hpz`` fixed also visits layouts it does not apply to."""
    return zero_hpz if lay.zero == 3 and zero_hpz > 1 and (lay.dp * lay.cp) % zero_hpz == 0 else 1


def exact_zero_units(m: ModelSpec, lay: Layout, bucket_mb: float = 25.0, zero_unit: int = 1,
                     params: list[ParamEntry] | None = None, zero_hpz: int = 1,
                     first_rank_blocks: set[int] | None = None) -> ZeroUnits | None:
    """The engine's padded flat units (:mod:`shardwise.plan.zero_layout`) when the layout is one the
    ZeRO engine runs (ZeRO >= 1, dense model, no tp; sharded over dp·cp); None otherwise (the paper's formula).
    With a pipeline, those of pipeline rank 0, whose blocks ``first_rank_blocks`` names (None: no exact units,
    since rank 0 need not be the busiest stage). ``zero_hpz`` is ``parallel.zero_hpz`` (ZeRO++ hpZ secondary
    partitions, see :func:`hpz_of`)."""
    if lay.zero == 0 or m.n_experts or lay.tp != 1 or (lay.pp > 1 and first_rank_blocks is None):
        return None
    params = params if params is not None else model_params(m)
    if lay.pp > 1:
        params = first_rank_params(params, first_rank_blocks)
    return zero_units(params, lay.zero, lay.dp * lay.cp, bucket_mb, zero_unit, hpz_of(lay, zero_hpz))


def model_state_lines(m: ModelSpec, lay: Layout, states: StateDtypes, out: MemoryBreakdown,
                      units: ZeroUnits | None = None, zero_hpz: int = 1) -> None:
    """Weights, gradients, master weights and optimizer states of one rank; expert parameters
    are sharded over their own data-parallel group of dp·cp/ep ranks.

    With ``units`` (:func:`exact_zero_units`) the bytes are the engine's, to the byte, on its
    busiest rank (rank 0): each flat unit padded to a multiple of N_d; the paper's unpadded
    Ψ/N_d value is kept in each line's ``paper_bytes`` and formula.

    ZeRO++ hpZ (``zero_hpz`` = h, ZeRO-3; Wang et al. 2023 §3.2) adds the secondary partitions to
    the parameters: the engine's Σ_u padded_u/h over the non-root units with ``units``, else the
    paper's M/h (Ψ_rank/h weights)."""
    dense, expert = params_per_rank(m, lay)
    shard = lay.dp * lay.cp
    z = zero_model_states(dense, shard, lay.zero, states)
    ze = zero_model_states(expert, max(1, shard // lay.ep), lay.zero, states) if expert else dict.fromkeys(z, 0.0)
    b = states.bytes()
    exact = engine_state_bytes(units, b, 0, lay.offload != "none") if units is not None else None
    sharded_from = {"params": 3, "grads": 2, "master": 1, "optimizer": 1}
    offloaded = {"master", "optimizer"} | ({"grads"} if lay.zero >= 2 else set()) if lay.offload != "none" else set()
    for key, stage in sharded_from.items():
        if b[key] == 0 and not (exact and exact[key]):
            continue
        formula = f"{b[key]} B x Psi_rank" + (f" / N_d (dp·cp = {shard})" if lay.zero >= stage else "")
        paper = z[key] + ze[key]
        value = paper
        if exact is not None:
            value = exact[key]
            kind = "root + block units" if lay.zero == 3 else "reverse-order buckets"
            formula += (f"; engine: {len(units.numels)} flat units ({kind}), each padded to a multiple of "
                        f"N_d={lay.dp} (+{units.padding} elements), rank 0 (paper: {paper:,.0f} B)")
            if key == "params" and units.secondary_numel:
                formula += (f"; + hpZ secondary partitions {units.secondary_numel:,} elements "
                            f"(non-root units' padded/h, h={units.hpz})")
        elif key == "params" and (h := hpz_of(lay, zero_hpz)) > 1:
            value += dense * b["params"] / h
            formula += f" + hpZ secondary partition Psi_rank/h (h={h}, ZeRO++ §3.2)"
            if key == "master" and b[key] == 0:
                formula = "4 B x own slice: fp32 master pieces kept apart for offload (engine's MasterStore)"
        if key in offloaded:
            out.add(f"mem_{key}_bytes", value, formula, "Ren et al. 2021 (ZeRO-Offload) §4",
                    "host" if lay.offload == "cpu" else "disk", paper_bytes=paper)
        else:
            out.add(f"mem_{key}_bytes", value, formula, "Rajbhandari et al. 2019 (ZeRO) §3.1, §5", paper_bytes=paper)


def pipeline_flush_lines(m: ModelSpec, lay: Layout, states: StateDtypes, out: MemoryBreakdown,
                         units: ZeroUnits | None = None) -> None:
    """ZeRO-2/3 inside a pipeline (shardwise.parallel.zero ``pipeline_step``, as FSDP inside torchtitan's
    pipelines): the gradients of every micro-batch accumulate unsharded until the flush, then are
    reduce-scattered once; ZeRO-3 keeps the stage's parameters gathered from its first forward to the flush.
    So during the step a rank also holds its stage's full gradients and (ZeRO-3) its full parameters --
    the engine's padded units with ``units``, else Ψ_rank. Sharding pays off between steps (the optimizer's
    states, ZeRO-1) and in the memory the stage's weights and gradients leave between steps."""
    if lay.pp == 1 or lay.zero < 2 or lay.dp * lay.cp == 1:
        return
    dense, expert = params_per_rank(m, lay)
    psi = units.psi_padded if units is not None else dense + expert
    what = f"padded units ({psi:,} elements)" if units is not None else "Psi_rank"
    b = states.bytes()
    source = "ZeRO §5.2-5.3 with one reduce-scatter per step (torchtitan's FSDP in a pipeline)"
    out.add("mem_grad_accum_bytes", psi * b["grads"], f"{b['grads']} B x {what}: gradients accumulated unsharded "
            f"over {lay.grad_accum} micro-batches until the flush", source)
    if lay.zero == 3:
        out.add("mem_gathered_bytes", psi * b["params"], f"{b['params']} B x {what}: the stage's parameters "
                "gathered from its first forward to the flush", source)


# ---- activations ----------------------------------------------------------------------------


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int = 1) -> dict[str, float]:
    """Activation bytes per transformer layer, Korthikanti et al. 2022, Table 2, verbatim."""
    return {
        "none": s * b * h * (34 + 5 * a * s / h),
        "tp": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": s * b * h / t * (34 + 5 * a * s / h),
        "tp+selective": s * b * h * (10 + 24 / t),
        "tp+sp+selective": s * b * h * 34 / t,
        "full": 2 * s * b * h,
    }


ACT_MODES = ("16bit", "fp32", "autocast")
"""How activations are stored: "16bit" (Korthikanti et al.: every saved tensor 2 bytes), "fp32",
or "autocast" (torch.autocast over fp32 weights, what shardwise trains with for bf16/fp16: the
residual stream and norms stay fp32, each matmul saves its own 2-byte cast of its input, and the
2-byte casts of the weights are kept until backward)."""


def activation_mode(precision: str, states: StateDtypes) -> str:
    """The activation storage of ``train.precision`` with model states ``states``."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if states.weights == "fp32" else "16bit"


def activation_bytes_per_layer(m: ModelSpec, s: int, b: int, t: int = 1, sp: bool = False, recompute: str = "none",
                               attention: str = "eager", dropout: bool | None = None, mode: str = "16bit") -> float:
    """Bytes one layer keeps for backward, term by term after Korthikanti et al. 2022 §4.1,
    generalised to grouped-query attention, any d_ff, SwiGLU, RMSNorm and dropout-free models.

    With gpt2 shapes (d_ff = 4h, no GQA), dropout, ``attention="eager"`` and ``mode="16bit"``
    this is exactly Table 2. ``attention="flash"`` (fused kernels such as
    scaled_dot_product_attention; Dao et al. 2022) keeps no s×s matrices, only the output and a
    fp32 log-sum-exp per row and head. RMSNorm (computed in fp32, Llama reference) keeps its
    fp32 input and normalised value. See ``ACT_MODES`` for ``mode``."""
    if mode not in ACT_MODES:
        raise ValueError(f"activation mode {mode!r}; use one of {ACT_MODES}")
    dropout = m.dropout > 0 if dropout is None else dropout
    h, kv, f, a = m.d_model, m.kv_dim, m.d_ff, m.n_heads
    sb = s * b
    res = 2 if mode == "16bit" else 4  # residual stream / norm input
    lin = 4 if mode == "fp32" else 2  # what a matmul saves of its input
    auto = mode == "autocast"
    if recompute == "full":
        return res * sb * h / (t if sp else 1)
    mask = 1 if dropout else 0  # one byte per element
    llama = m.flavor == "llama"
    norm = (4 if mode == "16bit" else res) + 4 if llama else res
    qkv_in = (3 if auto else 1) * lin
    mlp_in = (2 if auto and llama else 1) * lin
    # replicated over tp unless sequence parallel: two norms, QKV input, MLP input, two dropout masks
    replicated = (2 * norm + qkv_in + mlp_in + 2 * mask) * sb * h
    # split over tp: Q, K, V (after rotation), attention output (o_proj input), MLP internals
    attn_out = m.n_heads * (m.v_head_dim or m.head_dim) if m.kv_lora_rank else m.q_dim  # o_proj's input width
    qkv = lin * sb * (m.q_dim + kv + (m.value_dim if m.kv_lora_rank else kv))
    out_proj = lin * sb * attn_out
    mlp = (2 * lin * sb * f) if not llama else (4 * lin * sb * f)
    split = qkv + out_proj + mlp
    if attention == "eager" and recompute != "selective":
        scores = (lin + mask + (lin if dropout else 0)) * a * s * s * b  # softmax out, mask, dropout out
    elif attention == "flash" and recompute != "selective":
        scores = 4 * a * sb  # fp32 log-sum-exp
    else:
        scores = 0.0
    weight_casts = 2 * (block_params(m) - block_norms(m) - _block_biases(m)) if auto else 0
    return (replicated / (t if sp else 1)) + (split + scores + weight_casts) / t


def _block_biases(m: ModelSpec) -> int:
    if m.flavor != "gpt2":
        return 0
    return 2 * m.d_model + 2 * m.kv_dim + max(1, m.n_experts) * (m.d_ff + m.d_model)


def output_layer_bytes(m: ModelSpec, s: int, b: int, t: int = 1, mode: str = "16bit") -> float:
    """Final norm, head input and fp32 logits for the loss: 4sbh/t·(1 + v/h) in 16 bits
    (Korthikanti et al. 2022 §4.3), with the same per-mode storage as the layers."""
    res = 2 if mode == "16bit" else 4
    lin = 4 if mode == "fp32" else 2
    norm = (4 if mode == "16bit" else res) + 4 if m.flavor == "llama" else res
    casts = 2 * m.vocab_size * m.d_model if mode == "autocast" else 0
    return (s * b * (norm * m.d_model + lin * m.d_model + 4 * m.vocab_size) + casts) / t


def activation_lines(m: ModelSpec, lay: Layout, s: int, out: MemoryBreakdown, attention: str = "flash",
                     mode: str = "16bit") -> None:
    """Activations of the busiest (first) pipeline stage, plus the output layer without pipelining."""
    s_local = s // lay.cp
    b = lay.micro_batch
    per_layer = activation_bytes_per_layer(m, s_local, b, lay.tp, lay.sequence_parallel, lay.recompute, attention,
                                           mode=mode)
    layers = stage_blocks(m, lay)  # the busiest pipeline rank's (the trainer's even split)
    in_flight = min(lay.pp, lay.grad_accum) if lay.pp > 1 else 1
    interleave = 1 + (lay.pp - 1) / (lay.pp * lay.pp_virtual) if lay.pp_virtual > 1 else 1.0
    total = per_layer * layers * in_flight * interleave
    formula = (f"{per_layer:.4g} B/layer x L/pp={layers:g} x in-flight {in_flight}"
               + (f" x (1+(p-1)/(pv))={interleave:.3f}" if interleave != 1 else "") + f" [{mode}, {attention}]")
    out.add("mem_activations_bytes", total, formula, "Korthikanti et al. 2022 Table 2, §4.2.3")
    if lay.recompute == "full":
        work = activation_bytes_per_layer(m, s_local, b, lay.tp, lay.sequence_parallel, "none", attention, mode=mode)
        out.add("mem_activations_bytes", work, "one layer recomputed in backward (full activations)",
                "Chen et al. 2016, 'Training Deep Nets with Sublinear Memory Cost' §3")
    if lay.pp == 1:
        out.add("mem_activations_bytes", output_layer_bytes(m, s_local, b, lay.tp, mode),
                "output layer 4sbh/t·(1 + v/h) (fp32 logits)", "Korthikanti et al. 2022 §4.3")


def buffer_lines(m: ModelSpec, lay: Layout, states: StateDtypes, out: MemoryBreakdown, bucket_mb: float = 25.0) -> None:
    """Communication buffers: ZeRO-3 gathers one block and prefetches the next; ZeRO-1/2 reduce
    into fixed-size buckets (Rajbhandari et al. 2019, §6.2 'constant size buffers')."""
    if lay.dp * lay.cp == 1 or lay.zero == 0:
        return
    bucket = bucket_mb * 2**20
    if lay.zero == 3 and lay.pp > 1:  # the whole stage is gathered: mem_gathered_bytes
        out.add("mem_buffers_bytes", bucket, "1 reduce bucket (the gathered stage: mem_gathered_bytes)", "ZeRO §6.2")
    elif lay.zero == 3:
        gathered = 2 * block_params(m) / lay.tp * states.bytes()["params"]
        out.add("mem_buffers_bytes", gathered + bucket, "2 gathered blocks + 1 reduce bucket", "ZeRO §6.2")
    else:
        out.add("mem_buffers_bytes", 2 * bucket, "2 x parallel.bucket_mb reduce/gather buckets", "ZeRO §6.2")


def memory_breakdown(m: ModelSpec, lay: Layout, s: int, states: StateDtypes, attention: str = "flash",
                     act_mode: str = "16bit", bucket_mb: float = 25.0, zero_unit: int = 1,
                     params: list[ParamEntry] | None = None, zero_hpz: int = 1,
                     first_rank_blocks: set[int] | None = None) -> MemoryBreakdown:
    """Every memory line of one rank for ``lay``; ``act_mode`` from :func:`activation_mode`.
    ``bucket_mb``, ``zero_unit`` and ``zero_hpz`` are ``parallel.bucket_mb`` / ``parallel.zero_unit`` /
    ``parallel.zero_hpz``; ``params`` (:func:`shardwise.plan.zero_layout.model_params`, built when
    needed) saves rebuilding the model's parameter list for every layout of a search;
    ``first_rank_blocks``: with a pipeline, rank 0's blocks, for its exact ZeRO units (:func:`exact_zero_units`)."""
    out = MemoryBreakdown()
    units = exact_zero_units(m, lay, bucket_mb, zero_unit, params, zero_hpz, first_rank_blocks)
    model_state_lines(m, lay, states, out, units, zero_hpz)
    pipeline_flush_lines(m, lay, states, out, units)
    activation_lines(m, lay, s, out, attention, act_mode)
    buffer_lines(m, lay, states, out, bucket_mb)
    return out
