"""Parameter counts: exact, per component, for shardwise's model; and the literature's closed form.

The exact count follows ``shardwise.model.transformer`` line by line (GPT-2 flavour: Radford et al.
2019 §2.3; Llama flavour: Touvron et al. 2023 §2.2 with grouped-query attention, Ainslie et al.
2023) and equals ``Transformer(cfg).num_parameters()``. A mixture-of-experts block (Shazeer et al.
2017; Fedus et al. 2022, "Switch Transformers" §2) replaces the MLP with ``n_experts`` copies and a
bias-free router of ``d_model x n_experts``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.plan.spec import ModelSpec


@dataclass(frozen=True)
class ParamCount:
    """Parameters by component; ``total`` counts a tied output head once."""

    embedding: int
    position: int
    attention: int
    mlp: int
    """Dense MLPs, or every expert of the MoE blocks."""
    router: int
    norms: int
    head: int
    """Untied output projection (0 when tied to the token embedding)."""
    mlp_active: int
    """MLP parameters one token passes through (top-k experts of each MoE block)."""

    @property
    def total(self) -> int:
        return self.embedding + self.position + self.attention + self.mlp + self.router + self.norms + self.head

    @property
    def non_embedding(self) -> int:
        """Without the token and position tables (Kaplan et al. 2020 §2.1); an untied head is kept,
        as ``Transformer.num_parameters(exclude_embeddings=True)`` does."""
        return self.total - self.embedding - self.position

    @property
    def active(self) -> int:
        """Parameters one token uses (MoE: only its top-k experts)."""
        return self.total - self.mlp + self.mlp_active

    def as_dict(self) -> dict[str, int]:
        return {"embedding": self.embedding, "position": self.position, "attention": self.attention,
                "mlp": self.mlp, "router": self.router, "norms": self.norms, "head": self.head,
                "total": self.total, "non_embedding": self.non_embedding, "active": self.active}


def attention_params(m: ModelSpec) -> int:
    """One block's attention: q, k, v, o projections of ``n_heads * head_dim`` (and ``n_kv_heads * head_dim``)
    columns, 2·h·(q + kv) for ``head_dim = h / n_heads`` (biases for gpt2 and bert: q + 2 kv + h; Qwen2: q + 2 kv);
    latent attention (DeepSeek-V2 §2.1): the query pair (or one projection) with its norm, the key-value
    down-projection with the shared rotary part and its norm, the up-projection to every head's keys and values,
    and the output projection."""
    h, q, kv = m.d_model, m.q_dim, m.kv_dim
    if m.kv_lora_rank:
        r_q, r_kv, rope, v = m.q_lora_rank, m.kv_lora_rank, m.rope_dim, m.v_head_dim or m.head_dim
        query = h * r_q + r_q + r_q * q if r_q else h * q
        nope = m.head_dim - rope
        return query + h * (r_kv + rope) + r_kv + r_kv * m.n_heads * (nope + v) + m.n_heads * v * h
    weights = 2 * h * q + 2 * h * kv
    if m.flavor in ("gpt2", "bert"):
        return weights + q + 2 * kv + h
    return weights + (q + 2 * kv if m.qkv_bias else 0)


def mlp_params(m: ModelSpec, width: int | None = None) -> int:
    """One dense MLP of inner ``width`` (default d_ff): GELU 2·h·f + f + h (gpt2, bert) or SwiGLU 3·h·f (llama)."""
    h, f = m.d_model, m.d_ff if width is None else width
    return 2 * h * f + f + h if m.flavor in ("gpt2", "bert") else 3 * h * f


def norm_params(m: ModelSpec) -> int:
    """One norm: LayerNorm 2h (gain and bias) or RMSNorm h."""
    return 2 * m.d_model if m.flavor in ("gpt2", "bert") else m.d_model


def block_norms(m: ModelSpec) -> int:
    """One block's norm gains: two (four with Gemma's sandwich placement) of d_model, and QK-norm's (of a head,
    or of the whole q and k projections)."""
    qk = 0
    if m.qk_norm:
        qk = 2 * m.head_dim if m.qk_norm_scope == "head" else m.q_dim + m.kv_dim
    return (4 if m.norm_placement == "sandwich" else 2) * norm_params(m) + qk


def shared_params(m: ModelSpec) -> int:
    """An MoE block's shared experts: one MLP ``moe_shared`` times as wide as a routed expert."""
    return mlp_params(m, m.moe_shared * m.expert_d_ff) if m.n_experts and m.moe_shared else 0


def count_params(m: ModelSpec) -> ParamCount:
    """Exact parameter count of ``shardwise.model.Transformer`` for ``m``, by component."""
    layers = m.n_layers
    moe = m.moe_blocks  # shardwise.model.moe.is_moe_layer
    shared = shared_params(m)
    dense = (layers - moe) * mlp_params(m)
    return ParamCount(
        embedding=m.vocab_size * m.d_model,
        position=m.max_seq_len * m.d_model if m.flavor in ("gpt2", "bert") else 0,
        attention=layers * attention_params(m),
        mlp=dense + moe * (m.n_experts * mlp_params(m, m.expert_d_ff) + shared),
        router=moe * m.d_model * m.n_experts,
        norms=layers * block_norms(m) + norm_params(m),
        head=0 if m.tie_embeddings else m.vocab_size * m.d_model,
        mlp_active=dense + moe * (min(m.moe_top_k, m.n_experts) * mlp_params(m, m.expert_d_ff) + shared),
    )


def block_params(m: ModelSpec) -> int:
    """Parameters of one (MoE, where the model has experts) transformer block: attention, MLP or experts with
    router and shared experts, its norms and QK-norm gains."""
    mlps = m.n_experts * mlp_params(m, m.expert_d_ff) if m.n_experts else mlp_params(m)
    return attention_params(m) + mlps + shared_params(m) + m.d_model * m.n_experts + block_norms(m)


def closed_form_params(n_layers: int, d_model: int, vocab_size: int, seq_len: int) -> int:
    """12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)) — the GPT parameter count of Narayanan et al. 2021
    ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §5.1,
    Table 1): 12h²+13h per block, V·h token and s·h position embeddings. It leaves out the final
    LayerNorm (2h), so for the gpt2 flavour ``count_params(m).total == closed_form + 2h``."""
    L, h = n_layers, d_model
    return 12 * L * h * h + 13 * L * h + (vocab_size + seq_len) * h  # the same, multiplied out, in integers
