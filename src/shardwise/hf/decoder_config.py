"""Our llama-flavour model fields as the config.json of a ``transformers`` decoder family (pure Python).

:func:`decoder_config` writes the family's keys from our fields, then reads them back with
:func:`~shardwise.hf.decoders.decoder_fields` and compares every architecture field, in the form that
determines the function (``head_dim`` unset is ``d_model / n_heads``, ...): a field the family cannot say is
refused with one line naming it, instead of an export that ``transformers`` would load as another model.
"""

from __future__ import annotations

from typing import Any

from shardwise.hf.decoders import ARCHITECTURE, FAMILIES, HFError, decoder_fields, rope_block
from shardwise.model.rope_scaling import parse_rope_scaling


def implied_family(m) -> str:
    """The ``transformers`` family whose distinguishing feature our fields ``m`` have (``model.hf_model_type``
    unset)."""
    if m.kv_lora_rank:
        return "deepseek_v3"
    if m.n_experts:
        return "qwen3_moe" if m.qk_norm else "mixtral"
    if m.norm_placement == "sandwich":
        return "gemma3_text" if m.qk_norm else "gemma2"
    if m.norm_placement == "post":
        return "olmo2"
    if m.qk_norm:
        return "qwen3"
    if m.qkv_bias:
        return "qwen2"
    if m.rope_dim and m.rope_dim != _head_dim(m):
        return "phi3"
    return "mistral" if m.sliding_window else "llama"


def family_of(m) -> str:
    """The family an export of ``m`` writes: ``model.hf_model_type``, or :func:`implied_family`."""
    return m.hf_model_type or implied_family(m)


def _head_dim(m) -> int:
    return m.head_dim or m.d_model // m.n_heads


def effective(m) -> dict[str, Any]:
    """The architecture fields of ``m`` (an object or a dict of fields) in the form that decides the function:
    defaults resolved, fields that a model does not read left out."""
    get = m.get if isinstance(m, dict) else lambda k, d=None: getattr(m, k, d)
    from shardwise.config import ModelConfig

    default = ModelConfig()
    f = {k: get(k, getattr(default, k)) for k in ARCHITECTURE}
    hd = f["head_dim"] = f["head_dim"] or f["d_model"] // f["n_heads"]
    f["rope_dim"] = f["rope_dim"] or hd
    f["v_head_dim"] = f["v_head_dim"] or hd if f["kv_lora_rank"] else None
    f["attn_scale_dim"] = float(f["attn_scale_dim"] or hd)
    f["rope_scaling"] = parse_rope_scaling(f["rope_scaling"])
    for key in ("rope_theta", "norm_eps", "attn_softcap", "final_softcap", "rope_local_theta", "moe_gate_scale"):
        f[key] = float(f[key] or 0.0)
    if not f["qk_norm"]:
        f["qk_norm_scope"] = None
    if not f["sliding_window"]:
        f["sliding_global_every"] = None
    if not (f["sliding_window"] and f["sliding_global_every"]):
        f["rope_local_theta"] = None
    if not f["kv_lora_rank"]:
        f["q_lora_rank"] = None
    if f["n_experts"]:
        f["moe_d_ff"] = f["moe_d_ff"] or f["d_ff"]
        if f["moe_groups"] == 1:
            f["moe_group_top_k"] = None
    else:
        for key in ARCHITECTURE[ARCHITECTURE.index("moe_top_k"):]:
            f[key] = None
    return f


def decoder_config(m, common: dict[str, Any]) -> dict[str, Any]:
    """The config.json of our llama-flavour fields ``m`` as ``model.hf_model_type`` (or :func:`implied_family`),
    with ``common`` (vocabulary, tokens, dtype); HFError naming the first field the family cannot express."""
    kind = family_of(m)
    family = FAMILIES[kind]
    hd = _head_dim(m)
    out = {**common, "architectures": [family.architecture], "model_type": kind, "num_hidden_layers": m.n_layers,
           "hidden_size": m.d_model, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
           "head_dim": hd, "intermediate_size": m.d_ff, "max_position_embeddings": m.max_seq_len,
           "rms_norm_eps": m.norm_eps, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
           "rope_theta": m.rope_theta, "rope_parameters": rope_block(m.rope_scaling, m.rope_theta),
           "use_cache": True, "pad_token_id": None}
    out.update(_WRITERS[kind](m, hd))
    for key in _UNSAID.get(kind, ()):
        out.pop(key)
    theirs, ours = effective(decoder_fields(out, f"model_type {kind!r}")), effective(m)
    for key in ARCHITECTURE:
        if theirs[key] != ours[key]:
            raise HFError(f"model.{key}={getattr(m, key, None)!r}: transformers' {family.architecture} (model_type "
                          f"{kind!r}) cannot express it (its config.json would give {theirs[key]!r}); export a model "
                          "without it, or set model.hf_model_type to a family that has it")
    return out


def _window(m) -> dict:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layers}


def _layer_types(m) -> list[str]:
    k = m.sliding_global_every
    return ["full_attention" if k and (i + 1) % k == 0 else "sliding_attention" for i in range(m.n_layers)]


def _gemma(m, hd: int, gemma3: bool) -> dict:
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _number(m.attn_scale_dim or hd),
           "sliding_window": m.sliding_window or None, "final_logit_softcapping": m.final_softcap or None,
           "attn_logit_softcapping": m.attn_softcap or None, "use_bidirectional_attention": False}
    if m.sliding_window:
        out["layer_types"] = _layer_types(m)
    if gemma3:
        local = {"rope_type": "default", "rope_theta": m.rope_local_theta or m.rope_theta}
        out["rope_parameters"] = {"full_attention": rope_block(m.rope_scaling, m.rope_theta),
                                  "sliding_attention": local}
        out["attn_logit_softcapping"] = None
    return out


def _number(x: float) -> int | float:
    """An integral value as an int (transformers' strict config classes type some keys int)."""
    return int(x) if float(x).is_integer() else x


def _moe(m, hd: int, kind: str) -> dict:
    common = {"num_experts_per_tok": m.moe_top_k, "router_aux_loss_coef": m.moe_aux_coeff,
              "output_router_logits": False, "router_jitter_noise": 0.0}
    if kind == "mixtral":
        return {**common, "num_local_experts": m.n_experts, "sliding_window": None}
    return {**common, **_window(m), "num_local_experts": m.n_experts, "moe_intermediate_size": m.moe_d_ff or m.d_ff,
            "decoder_sparse_step": m.moe_every, "mlp_only_layers": [],
            "norm_topk_prob": m.moe_router == "softmax_renorm"}


def _deepseek(m, hd: int) -> dict:
    return {"qk_nope_head_dim": hd - m.rope_dim, "qk_rope_head_dim": m.rope_dim,
            "v_head_dim": m.v_head_dim or hd, "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or None,
            "n_routed_experts": m.n_experts, "num_experts_per_tok": m.moe_top_k,
            "first_k_dense_replace": m.moe_dense_first, "moe_intermediate_size": m.moe_d_ff or m.d_ff,
            "n_shared_experts": m.moe_shared, "n_group": m.moe_groups, "topk_group": m.moe_group_top_k,
            "routed_scaling_factor": m.moe_gate_scale, "norm_topk_prob": True, "rope_interleave": True}


_UNSAID = {"gemma2": ("hidden_act",), "gemma3_text": ("hidden_act",), "deepseek_v3": ("head_dim",)}
"""Keys of the common part a family's class does not have."""
_WRITERS = {
    "llama": lambda m, hd: {"mlp_bias": False},
    "qwen2": lambda m, hd: _window(m),
    "qwen3": lambda m, hd: _window(m),
    "mistral": lambda m, hd: {"sliding_window": m.sliding_window or None},
    "gemma2": lambda m, hd: _gemma(m, hd, False),
    "gemma3_text": lambda m, hd: _gemma(m, hd, True),
    "olmo2": lambda m, hd: {},
    "phi3": lambda m, hd: {"partial_rotary_factor": (m.rope_dim or hd) / hd, "sliding_window": m.sliding_window or None,
                           "original_max_position_embeddings": m.max_seq_len},
    "mixtral": lambda m, hd: _moe(m, hd, "mixtral"),
    "qwen3_moe": lambda m, hd: _moe(m, hd, "qwen3_moe"),
    "deepseek_v3": _deepseek,
}
assert set(_WRITERS) == set(FAMILIES)
