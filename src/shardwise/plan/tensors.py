"""The trainable tensors of a model, from its shape alone: name, size, block and tensor-parallel split.

The planner needs more than a parameter count where the trainer's bytes depend on *tensors*: ZeRO's flat
units pad per unit, data parallelism's buckets close at tensor boundaries and carry one flag per tensor,
tensor parallelism leaves some tensors whole. It derives them here from the shape (:class:`ModelSpec`)
and the architectures' papers, never from the trainer's model code, so that ``plan --compare`` holds two
independent descriptions against each other:

* **GPT-2** (Radford et al. 2019 §2.3, GPT's decoder with pre-norm): token and learned position tables;
  per block a LayerNorm (gain, bias), the q, k, v and output projections (h x h, with biases), a second
  LayerNorm, the MLP h -> d_ff -> h (with biases); a final LayerNorm; the output head tied to the token
  table (Press & Wolf 2017), so it adds no tensor.
* **Llama** (Touvron et al. 2023 §2.2): RMSNorm gains only, projections without biases, grouped-query
  key/value projections of n_kv_heads heads (Ainslie et al. 2023), SwiGLU's gate, up and down (Shazeer
  2020), an untied head.
* **Mixture of experts** (Fedus et al. 2022, "Switch Transformers" §2; GShard's every-other-layer placement
  for ``moe_every`` 2): the MoE block's MLP is a bias-free router (E x h) and E experts of the flavour's
  MLP, each tensor stacked over the experts; ``moe_shared`` shared experts (DeepSeekMoE, Dai et al. 2024)
  one MLP ``moe_shared`` times as wide as a routed expert.
* The **BERT** flavour is planned as GPT-2 (its token-type table, embedding norm, MLM transform and output
  bias are left out, a documented gap); ``tests/test_plan_model.py`` lists the difference.

Order: the order a module registers them, which DDP's buckets follow (Li et al. 2020, "PyTorch
Distributed", §3.2.3: buckets in reverse registration order): embeddings, blocks in order (norm, q, k, v,
output, norm, MLP: router, experts, shared), final norm, head; a weight before its bias. Names are the
checkpoint's single-process names (the layout-free checkpoint format, a public interface).

Tensor-parallel split (Megatron-LM, Shoeybi et al. 2019 §3): q / k / v and the MLP's first layer(s)
column-parallel ("column"; k / v "column_kv": replicated on tp / n_kv_heads ranks where tp > n_kv_heads),
the output projection and the MLP's last layer row-parallel ("row": the weight split, the bias whole),
token table and head over the vocabulary ("vocab"); norms, the position table, routers and experts whole
("whole": MoE blocks are not tensor-parallel here).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.parallel.pipeline.checks import even_stage_sizes
from shardwise.plan.spec import Layout, ModelSpec

SPLITS = ("vocab", "column", "column_kv", "row", "whole")


@dataclass(frozen=True)
class ParamEntry:
    """One trainable tensor of the model, in registration order."""

    name: str
    numel: int
    block: int | None
    """Index of the transformer block it belongs to (None: embeddings, final norm, head)."""
    split: str = "whole"
    """How tensor parallelism splits it (:data:`SPLITS`)."""


def _gelu_style(m: ModelSpec) -> bool:
    return m.flavor in ("gpt2", "bert")


def is_moe_block(m: ModelSpec, block: int) -> bool:
    """Every ``moe_every``-th block is MoE, the last of each run (GShard: blocks 1, 3, 5, ... for 2), past the
    first ``moe_dense_first``."""
    return m.is_moe_block(block)


def _linear(prefix: str, out: int, inp: int, bias: bool, block: int | None, split: str,
            stack: int = 1) -> list[ParamEntry]:
    """A linear layer's weight (out x inp) and bias, ``stack`` copies stacked (experts)."""
    weight = ParamEntry(f"{prefix}.weight", stack * out * inp, block, split)
    if not bias:
        return [weight]
    return [weight, ParamEntry(f"{prefix}.bias", stack * out, block, "whole" if split == "row" else split)]


def _mlp(prefix: str, m: ModelSpec, width: int, block: int, split: bool, stack: int = 1) -> list[ParamEntry]:
    """The flavour's MLP h -> width -> h: GELU's two layers with biases, or SwiGLU's three without."""
    col, row = ("column", "row") if split else ("whole", "whole")
    h, bias = m.d_model, _gelu_style(m)
    if bias:
        return [*_linear(f"{prefix}.fc_in", width, h, True, block, col, stack),
                *_linear(f"{prefix}.fc_out", h, width, True, block, row, stack)]
    return [*_linear(f"{prefix}.gate_proj", width, h, False, block, col, stack),
            *_linear(f"{prefix}.up_proj", width, h, False, block, col, stack),
            *_linear(f"{prefix}.down_proj", h, width, False, block, row, stack)]


def _norm(prefix: str, m: ModelSpec, block: int | None) -> list[ParamEntry]:
    """LayerNorm's gain and bias, or RMSNorm's gain."""
    out = [ParamEntry(f"{prefix}.weight", m.d_model, block)]
    return [*out, ParamEntry(f"{prefix}.bias", m.d_model, block)] if _gelu_style(m) else out


def _attention(p: str, m: ModelSpec, b: int) -> list[ParamEntry]:
    """One block's attention tensors: q, k, v, o (biases for gpt2 and bert; q, k, v's for Qwen2) and QK-norm
    gains; or latent attention's (DeepSeek-V2 §2.1), its down-projections and their norms whole."""
    h, q, kv = m.d_model, m.q_dim, m.kv_dim
    if m.kv_lora_rank:
        r_q, r_kv, heads = m.q_lora_rank, m.kv_lora_rank, m.n_heads
        nope, v = m.head_dim - m.rope_dim, m.v_head_dim or m.head_dim
        query = [*_linear(f"{p}.q_a_proj", r_q, h, False, b, "whole"), ParamEntry(f"{p}.q_norm.weight", r_q, b),
                 *_linear(f"{p}.q_b_proj", q, r_q, False, b, "column")] if r_q else \
            _linear(f"{p}.q_proj", q, h, False, b, "column")
        return [*query, *_linear(f"{p}.kv_a_proj", r_kv + m.rope_dim, h, False, b, "whole"),
                ParamEntry(f"{p}.kv_norm.weight", r_kv, b),
                *_linear(f"{p}.kv_b_proj", heads * (nope + v), r_kv, False, b, "column"),
                *_linear(f"{p}.o_proj", h, heads * v, False, b, "row")]
    bias, qkv_bias = _gelu_style(m), _gelu_style(m) or m.qkv_bias
    out = [*_linear(f"{p}.q_proj", q, h, qkv_bias, b, "column"),
           *_linear(f"{p}.k_proj", kv, h, qkv_bias, b, "column_kv"),
           *_linear(f"{p}.v_proj", kv, h, qkv_bias, b, "column_kv"),
           *_linear(f"{p}.o_proj", h, q, bias, b, "row")]
    if m.qk_norm:
        whole = m.qk_norm_scope == "head"
        out += [ParamEntry(f"{p}.q_norm.weight", m.head_dim if whole else q, b, "whole" if whole else "column"),
                ParamEntry(f"{p}.k_norm.weight", m.head_dim if whole else kv, b, "whole" if whole else "column_kv")]
    return out


def model_params(m: ModelSpec) -> list[ParamEntry]:
    """The trainable tensors of the model of shape ``m``, in registration order (a tied head once, as the
    token table)."""
    h, bias = m.d_model, _gelu_style(m)
    out = [ParamEntry("tok_emb.weight", m.vocab_size * h, None, "vocab")]
    if bias:  # learned positions (GPT-2, BERT); Llama's rotary positions have no parameters
        out.append(ParamEntry("pos_emb.weight", m.max_seq_len * h, None))
    for b in range(m.n_layers):
        p = f"blocks.{b}"
        out += _norm(f"{p}.norm1", m, b)
        out += _attention(f"{p}.attn", m, b)
        out += _norm(f"{p}.norm2", m, b)
        if m.norm_placement == "sandwich":
            out += _norm(f"{p}.post_norm1", m, b) + _norm(f"{p}.post_norm2", m, b)
        if is_moe_block(m, b):
            out.append(ParamEntry(f"{p}.mlp.router.weight", m.n_experts * h, b))
            out += _mlp(f"{p}.mlp.experts", m, m.expert_d_ff, b, split=False, stack=m.n_experts)
            if m.moe_shared:
                out += _mlp(f"{p}.mlp.shared", m, m.moe_shared * m.expert_d_ff, b, split=False)
        else:
            out += _mlp(f"{p}.mlp", m, m.d_ff, b, split=True)
    out += _norm("norm_f", m, None)
    if not m.tie_embeddings:
        out.append(ParamEntry("lm_head.weight", m.vocab_size * h, None, "vocab"))
    return out


def even_stage_blocks(n_layers: int, stages: int, embedding_slot: bool = False,
                      head_slot: bool = False) -> list[range]:
    """The blocks of each of ``stages`` pipeline stages split evenly (GPipe, Huang et al. 2019 §2.1: K
    contiguous cells), the first stages one block longer, the embedding / head taking a block's place with
    their slots: the rule the trainer uses (:func:`shardwise.parallel.pipeline.checks.even_stage_sizes`, a
    function of the config alone). What the planner assumes for every ``parallel.pp_partition``: a partition
    balanced by parameters or FLOPs can differ from it."""
    out, start = [], 0
    for n in even_stage_sizes(n_layers, stages, embedding_slot, head_slot):
        out.append(range(start, start + n))
        start += n
    return out


def rank_blocks(m: ModelSpec, lay: Layout, rank: int) -> int:
    """Blocks pipeline rank ``rank`` holds over its ``pp_virtual`` chunks under the even split."""
    if lay.pp == 1:
        return m.n_layers
    sizes = even_stage_sizes(m.n_layers, lay.pp * lay.pp_virtual, lay.pp_embedding_slot, lay.pp_head_slot)
    return sum(sizes[c * lay.pp + rank] for c in range(lay.pp_virtual))


def stage_blocks(m: ModelSpec, lay: Layout) -> int:
    """The most blocks one pipeline rank holds (the busiest stage sets the memory and the pace)."""
    return max(rank_blocks(m, lay, r) for r in range(lay.pp))
