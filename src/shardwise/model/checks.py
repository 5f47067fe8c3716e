"""The config rules of the model's architecture fields (head width, rotary scaling, sliding windows, Gemma's,
OLMo 2's and DeepSeek's variations), functions of the config alone (no torch): each value in range, and
together a model the code builds, one line each."""

from __future__ import annotations

from shardwise.checks import Unused, choice, positive
from shardwise.config import Config, ConfigError, ModelConfig
from shardwise.model.rope_scaling import RopeScalingError, parse_rope_scaling

LLAMA_ONLY = ("head_dim", "qkv_bias", "rope_scaling", "rope_dim", "sliding_window",
              "attn_scale_dim", "attn_softcap", "final_softcap", "norm_placement", "norm_unit_offset",
              "mlp_activation", "embed_scale", "kv_lora_rank", "hf_model_type")
"""Fields of the llama flavour's architecture (rotary positions, RMSNorm, gated MLP)."""


def head_dim(m: ModelConfig) -> int:
    """``model.head_dim``, or ``d_model / n_heads``."""
    return m.head_dim or m.d_model // m.n_heads


def check_architecture(m: ModelConfig) -> None:
    """The architecture fields of a resolved model shape (n_layers, d_model, n_heads set)."""
    for key in ("norm_placement", "qk_norm_scope", "mlp_activation", "hf_model_type"):
        choice(f"model.{key}", getattr(m, key))
    for key in ("head_dim", "rope_dim", "v_head_dim"):
        positive(f"model.{key}", getattr(m, key))
    for key in ("sliding_window", "sliding_global_every", "q_lora_rank", "kv_lora_rank", "rope_local_theta",
                "attn_scale_dim", "attn_softcap", "final_softcap"):
        positive(f"model.{key}", getattr(m, key), allow_zero=True)
    if m.head_dim is None and m.d_model % m.n_heads:
        from shardwise.checks import divisors

        raise ConfigError(f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}; use one of "
                          f"{divisors(m.d_model)}, or give model.head_dim")
    if m.flavor != "llama":
        return  # the llama flavour's fields are refused by unused() below
    try:
        parse_rope_scaling(m.rope_scaling)
    except RopeScalingError as e:
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r}: {e}") from None
    hd = head_dim(m)
    if m.kv_lora_rank:
        _check_latent(m, hd)
        return
    rotated = m.rope_dim or hd
    if rotated % 2 or rotated > hd:
        what = f"model.rope_dim={m.rope_dim}" if m.rope_dim else f"the head width {hd}"
        raise ConfigError(f"{what} must be even and at most the head width ({hd}) for rotary embeddings")


def _check_latent(m: ModelConfig, hd: int) -> None:
    """Multi-head latent attention (:mod:`shardwise.model.mla`): what it is built from and what it has not."""
    if not m.rope_dim or m.rope_dim % 2 or m.rope_dim >= hd:
        raise ConfigError(f"model.rope_dim={m.rope_dim} with model.kv_lora_rank={m.kv_lora_rank}: the decoupled "
                          f"rotary part of each head must be even and below model.head_dim={hd}")
    for key, why in (("qk_norm", "normalises the latents instead"), ("qkv_bias", "has no biases"),
                     ("sliding_window", "attends to the whole prefix"), ("attn_softcap", "does not soft-cap"),
                     ("attn_scale_dim", "sets its own scale"), ("rope_local_theta", "has one rotation")):
        if getattr(m, key):
            raise ConfigError(f"model.{key}={getattr(m, key)!r} with model.kv_lora_rank={m.kv_lora_rank}: latent "
                              f"attention {why}; remove model.{key}")
    if m.norm_placement != "pre" or m.norm_unit_offset:
        raise ConfigError(f"model.norm_placement={m.norm_placement!r} with model.kv_lora_rank: the latent-attention "
                          "blocks we build are pre-norm with plain RMSNorm; use 'pre'")
    if m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} with model.kv_lora_rank={m.kv_lora_rank}: every head "
                          f"has its own keys and values from the latent; use {m.n_heads} (or leave it unset)")


def unused(cfg: Config) -> list[Unused]:
    m = cfg.model
    llama = m.flavor == "llama"
    rules = [Unused(f"model.{key}", llama, f"is part of the llama flavour's architecture; model.flavor="
                    f"{m.flavor!r} does not use it; use model.flavor='llama' or remove it") for key in LLAMA_ONLY]
    latent = bool(m.kv_lora_rank)
    rules += [
        Unused("model.qk_norm_scope", m.qk_norm, "says what QK-norm normalises, but model.qk_norm=false; set "
               "model.qk_norm=true or remove it"),
        Unused("model.sliding_global_every", m.sliding_window, "spaces the global blocks among sliding ones, but "
               "model.sliding_window=0; set model.sliding_window or remove it"),
        Unused("model.rope_local_theta", m.sliding_window and m.sliding_global_every, "rotates the sliding blocks "
               "apart from the global ones; set model.sliding_window and model.sliding_global_every or remove it"),
        Unused("model.q_lora_rank", latent, "is latent attention's; set model.kv_lora_rank or remove it"),
        Unused("model.v_head_dim", latent, "is latent attention's; set model.kv_lora_rank or remove it"),
    ]
    return rules
