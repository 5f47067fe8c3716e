"""The planner's view of a config: a resolved model shape and a (possibly open) layout.

:func:`shardwise.config_resolve.resolve` is the trainer's gate and rejects layouts the trainer cannot run yet
(tp/pp/cp/ep != 1, ZeRO, offload). The planner must reason about every layout, so it has its own
resolution path: it reuses the config dataclasses and the preset logic of
:func:`shardwise.config_resolve.resolve_model`, and checks only what the arithmetic needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardwise.config import Config, ConfigError, ModelConfig
from shardwise.config_resolve import resolve_model

BYTE_VOCAB = 257
"""Vocabulary of the byte tokenizer (shardwise.data.tokenizer.ByteTokenizer)."""

RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "disk")


@dataclass(frozen=True)
class ModelSpec:
    """Every shape the calculators need; built by :func:`model_spec`."""

    flavor: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    dropout: float = 0.0
    n_experts: int = 0
    """Experts per MoE block (0 = dense MLP): ``model.n_experts``."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_every: int = 1
    """Every k-th block is MoE (the others dense); the parameter count honours it, the memory and
    communication models assume every block is MoE."""
    moe_shared: int = 0
    """Shared experts (one MLP of moe_shared * expert_d_ff) in each MoE block; counted as always active."""
    moe_d_ff: int | None = None
    """Each routed expert's inner size (default d_ff)."""
    qk_norm: bool = False
    """llama: QK-norm gains, of head_dim per query and key (two per block), or over the whole projections."""
    head_dim: int | None = None
    """Width of a query-key head (default d_model / n_heads; with latent attention nope + rope dims)."""
    qkv_bias: bool = False
    """Biases on q, k and v only (Qwen2)."""
    qk_norm_scope: str = "head"
    """With qk_norm: "head" (gains of head_dim) or "projection" (gains over the whole q and k projections)."""
    norm_placement: str = "pre"
    """"sandwich" adds a norm after each sub-layer (four per block)."""
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    """Latent attention's ranks (0: ordinary attention)."""
    rope_dim: int | None = None
    """Latent attention: the decoupled rotary dims of each query and key head."""
    v_head_dim: int | None = None
    """Latent attention: width of a value head (default head_dim)."""
    moe_dense_first: int = 0
    """The first blocks keep a dense MLP."""
    sliding_window: int = 0
    sliding_global_every: int = 0
    """Sliding-window attention (keys within the window) in all blocks but every k-th."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """Width of all value heads together."""
        return self.n_heads * (self.v_head_dim or self.head_dim) if self.kv_lora_rank else self.kv_dim

    def is_moe_block(self, layer: int) -> bool:
        """Whether block ``layer`` has experts (:func:`shardwise.model.moe.is_moe_layer`'s rule)."""
        return self.n_experts > 0 and layer >= self.moe_dense_first and layer % self.moe_every == self.moe_every - 1

    @property
    def moe_blocks(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layers))

    def is_sliding_block(self, layer: int) -> bool:
        every = self.sliding_global_every
        return self.sliding_window > 0 and (every <= 0 or (layer + 1) % every != 0)


@dataclass(frozen=True)
class Layout:
    """One way to run a step: parallel sizes, ZeRO stage, batch split, recomputation."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    """Expert tensor parallelism: 1, or tp (each expert's hidden units split over the tp ranks)."""
    zero: int = 0
    offload: str = "none"
    micro_batch: int = 1
    grad_accum: int = 1
    """Micro-batches per optimizer step per data-parallel rank (= pipeline micro-batches m)."""
    recompute: str = "none"
    sequence_parallel: bool = False
    pp_virtual: int = 1
    pp_embedding_slot: bool = False
    """The embedding takes a block's place in the even pipeline split (``parallel.pp_embedding_slot``)."""
    pp_head_slot: bool = False
    """The head takes a block's place on the last stage (``parallel.pp_head_slot``)."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def short(self) -> str:
        s = f"dp{self.dp} tp{self.tp} pp{self.pp}"
        if self.cp > 1:
            s += f" cp{self.cp}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.etp > 1:
            s += f" etp{self.etp}"
        if self.pp_virtual > 1:
            s += f" v{self.pp_virtual}"
        s += f" z{self.zero} mb{self.micro_batch}"
        s += "" if self.recompute == "none" else f" rc-{self.recompute}"
        s += " sp" if self.sequence_parallel else ""
        s += "" if self.offload == "none" else f" off-{self.offload}"
        return s


def resolved_model(cfg: Config) -> ModelConfig:
    """A copy of ``cfg.model`` resolved (presets, defaults, checks) without the trainer's validation.

    An unset ``vocab_size`` is taken from the tokenizer: 257 for "byte", ``data.bpe_vocab_size``
    for "bpe", or the tokenizer file's vocabulary; an unset ``max_seq_len`` (a custom shape) from
    ``data.seq_len``, as the trainer does."""
    m: ModelConfig = dataclasses.replace(cfg.model)
    vocab = _tokenizer_vocab(cfg) if m.vocab_size is None else None
    resolve_model(m, vocab, weights=False)  # an hf: directory's config.json is enough to plan
    if m.max_seq_len is None:
        m.max_seq_len = cfg.data.seq_len
    if m.max_seq_len is None:
        raise ConfigError("model.max_seq_len is not set; give it or data.seq_len")
    return m


def model_spec(cfg: Config, n_experts: int | None = None, moe_top_k: int | None = None) -> ModelSpec:
    """The shapes of :func:`resolved_model`; ``n_experts`` / ``moe_top_k`` override the config's."""
    m = resolved_model(cfg)
    n_experts = m.n_experts if n_experts is None else n_experts
    moe_top_k = m.moe_top_k if moe_top_k is None else moe_top_k
    if n_experts < 0 or (n_experts and not 1 <= moe_top_k <= n_experts):
        raise ConfigError(f"model.moe_top_k={moe_top_k} must be in [1, model.n_experts={n_experts}]")
    return ModelSpec(
        flavor=m.flavor, n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
        d_ff=m.d_ff, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, tie_embeddings=bool(m.tie_embeddings),
        dropout=m.dropout, n_experts=n_experts, moe_top_k=moe_top_k, moe_every=m.moe_every,
        moe_shared=m.moe_shared, moe_d_ff=m.moe_d_ff, qk_norm=m.qk_norm, **architecture_of(m),
    )


ARCHITECTURE_FIELDS = ("head_dim", "qkv_bias", "qk_norm_scope", "norm_placement", "q_lora_rank", "kv_lora_rank",
                       "rope_dim", "v_head_dim", "moe_dense_first", "sliding_window", "sliding_global_every")
"""The model fields a :class:`ModelSpec` carries beyond the shape (the same names on both)."""


def architecture_of(m) -> dict:
    """The :data:`ARCHITECTURE_FIELDS` of a model config (gpt2 and bert have none of them)."""
    if m.flavor != "llama":
        return {}
    out = {k: getattr(m, k) for k in ARCHITECTURE_FIELDS}
    out["rope_dim"] = m.rope_dim if m.kv_lora_rank else None  # a partial rotation changes no shape
    return out


def seq_len_of(cfg: Config, model: ModelSpec) -> int:
    """``data.seq_len``, defaulting to the model's ``max_seq_len`` (as the trainer does)."""
    s = cfg.data.seq_len or model.max_seq_len
    if s > model.max_seq_len:
        raise ConfigError(f"data.seq_len={s} exceeds model.max_seq_len={model.max_seq_len}; "
                          f"use at most {model.max_seq_len}")
    return s


def _tokenizer_vocab(cfg: Config) -> int | None:
    tok = cfg.data.tokenizer
    if tok == "byte":
        return BYTE_VOCAB
    if tok == "bpe":
        return cfg.data.bpe_vocab_size
    try:
        import json
        from pathlib import Path

        data = json.loads(Path(tok).read_text())
        vocab = data["model"]["vocab"]
        return len(vocab) + sum(1 for t in data.get("added_tokens", []) if t["content"] not in vocab)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def model_config_of(spec: ModelSpec) -> ModelConfig:
    """A fully resolved ``ModelConfig`` for ``spec``, e.g. to build ``Transformer``."""
    return ModelConfig(
        preset="custom", flavor=spec.flavor, n_layers=spec.n_layers, d_model=spec.d_model, n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads, d_ff=spec.d_ff, vocab_size=spec.vocab_size, max_seq_len=spec.max_seq_len,
        tie_embeddings=spec.tie_embeddings, dropout=spec.dropout, n_experts=spec.n_experts,
        moe_top_k=spec.moe_top_k, moe_every=spec.moe_every, moe_shared=spec.moe_shared, moe_d_ff=spec.moe_d_ff,
        qk_norm=spec.qk_norm, **({k: getattr(spec, k) for k in ARCHITECTURE_FIELDS} if spec.flavor == "llama" else {}),
    )
