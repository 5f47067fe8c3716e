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
    """One block's q, k, v, o projections (biases for gpt2): 2·h·(h + h_kv) (+ 2h + 2h_kv)."""
    h, kv = m.d_model, m.kv_dim
    weights = 2 * h * h + 2 * h * kv
    return weights + (2 * h + 2 * kv if m.flavor in ("gpt2", "bert") else 0)


def mlp_params(m: ModelSpec, width: int | None = None) -> int:
    """One dense MLP of inner ``width`` (default d_ff): GELU 2·h·f + f + h (gpt2, bert) or SwiGLU 3·h·f (llama)."""
    h, f = m.d_model, m.d_ff if width is None else width
    return 2 * h * f + f + h if m.flavor in ("gpt2", "bert") else 3 * h * f


def norm_params(m: ModelSpec) -> int:
    """One norm: LayerNorm 2h (gain and bias) or RMSNorm h."""
    return 2 * m.d_model if m.flavor in ("gpt2", "bert") else m.d_model


def count_params(m: ModelSpec) -> ParamCount:
    """Exact parameter count of ``shardwise.model.Transformer`` for ``m``, by component."""
    layers = m.n_layers
    moe = m.n_layers // m.moe_every if m.n_experts else 0  # shardwise.model.moe.is_moe_layer
    shared = mlp_params(m, m.moe_shared * m.d_ff) if m.moe_shared else 0
    dense = (layers - moe) * mlp_params(m)
    return ParamCount(
        embedding=m.vocab_size * m.d_model,
        position=m.max_seq_len * m.d_model if m.flavor in ("gpt2", "bert") else 0,
        attention=layers * attention_params(m),
        mlp=dense + moe * (m.n_experts * mlp_params(m, m.expert_d_ff) + shared),
        router=moe * m.d_model * m.n_experts,
        norms=(2 * layers + 1) * norm_params(m) + (2 * layers * m.head_dim if m.qk_norm else 0),
        head=0 if m.tie_embeddings else m.vocab_size * m.d_model,
        mlp_active=dense + moe * (min(m.moe_top_k, m.n_experts) * mlp_params(m, m.expert_d_ff) + shared),
    )


def block_params(m: ModelSpec) -> int:
    """Parameters of one (MoE, where the model has experts) transformer block: attention, MLP or experts with
    router and shared experts, two norms, QK-norm gains."""
    mlps = m.n_experts * mlp_params(m, m.expert_d_ff) if m.n_experts else mlp_params(m)
    shared = mlp_params(m, m.moe_shared * m.d_ff) if m.n_experts and m.moe_shared else 0
    qk = 2 * m.head_dim if m.qk_norm else 0
    return attention_params(m) + mlps + shared + m.d_model * m.n_experts + 2 * norm_params(m) + qk


def closed_form_params(n_layers: int, d_model: int, vocab_size: int, seq_len: int) -> int:
    """12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)) — the GPT parameter count of Narayanan et al. 2021
    ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §5.1,
    Table 1): 12h²+13h per block, V·h token and s·h position embeddings. It leaves out the final
    LayerNorm (2h), so for the gpt2 flavour ``count_params(m).total == closed_form + 2h``."""
    L, h = n_layers, d_model
    return 12 * L * h * h + 13 * L * h + (vocab_size + seq_len) * h  # the same, multiplied out, in integers
