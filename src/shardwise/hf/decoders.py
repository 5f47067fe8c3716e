"""The ``transformers`` decoder families of our llama flavour: their config.json keys, the defaults
``transformers`` gives the keys a file leaves out, and our model fields for them (pure Python, no torch).

Each family is a :class:`Family`: its ``model_type``, the class that loads it, the keys a file must give (the
shape) and the defaults of the others, copied from the family's ``transformers`` configuration class (5.x:
``LlamaConfig``, ``Qwen2Config``, ...), so that a key left out means what it means to ``transformers``. A key
whose value we cannot build is refused with one line naming it, its value and what we accept.

What each family adds to Llama (Touvron et al. 2023):

* ``llama`` -- Llama 3.1+ rotary scaling (``rope_type`` "llama3"), any ``head_dim``;
* ``qwen2`` -- biases on q, k and v (Bai et al. 2023, "Qwen Technical Report", §2.2);
* ``qwen3`` / ``qwen3_moe`` -- per-head QK-norm (Qwen Team 2025, "Qwen3 Technical Report", §2), ``head_dim``
  of its own; Qwen3-MoE's experts (``mixtral`` is Jiang et al. 2024's);
* ``mistral`` -- a sliding window in every layer (Jiang et al. 2023, "Mistral 7B", §2);
* ``gemma2`` / ``gemma3_text`` -- GeGLU, ``(1 + w)`` RMSNorm before and after each sub-layer, embeddings times
  sqrt(d), ``query_pre_attn_scalar``, local (sliding) and global layers, soft-capping (Gemma 2) or QK-norm and
  a rotation of their own for the local layers (Gemma Team 2024, "Gemma 2", §2; 2025, "Gemma 3", §2);
* ``olmo2`` -- norms after the sub-layers, QK-norm over the whole projections (Team OLMo 2024, §3.1);
* ``phi3`` -- fused ``qkv_proj`` / ``gate_up_proj`` tensors, partial rotary (Abdin et al. 2024, "Phi-3");
* ``deepseek_v3`` -- multi-head latent attention, shared and routed experts with the grouped sigmoid router
  and its balancing bias, the first blocks dense (DeepSeek-AI 2024, "DeepSeek-V3", §2.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ARCHITECTURE = ("flavor", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
                "max_seq_len", "norm_eps", "rope_theta", "rope_scaling", "rope_dim", "rope_local_theta",
                "tie_embeddings", "qk_norm", "qk_norm_scope", "qkv_bias", "sliding_window", "sliding_global_every",
                "attn_scale_dim", "attn_softcap", "final_softcap", "norm_placement", "norm_unit_offset",
                "mlp_activation", "embed_scale", "q_lora_rank", "kv_lora_rank", "v_head_dim", "n_experts",
                "moe_top_k", "moe_every", "moe_shared", "moe_d_ff", "moe_router", "moe_dense_first", "moe_groups",
                "moe_group_top_k", "moe_gate_scale")
"""The fields that make a llama-flavour model the function it is."""


SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


class HFError(ValueError):
    """An HF directory or model we cannot map: the message is one line naming the file, key and value."""


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    defaults: dict[str, Any] = field(default_factory=dict)
    """The optional keys we read and ``transformers``' defaults for them."""
    theta: float = 10000.0
    """The rotary base when the file gives none (the class's ``default_theta``)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Another name a file may give a key under -> the key (the class's ``attribute_map``)."""


_COMMON = {"num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
           "rope_parameters": None, "rope_scaling": None}
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None}
_GEMMA = {**_COMMON, "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh", "num_key_value_heads": 4,
          "head_dim": 256, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
          "layer_types": None, "use_bidirectional_attention": None}

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", {**_COMMON, "mlp_bias": False}),
    Family("qwen2", "Qwen2ForCausalLM", {**_COMMON, "num_key_value_heads": 32, "max_position_embeddings": 32768,
                                         **_QWEN_WINDOW}),
    Family("qwen3", "Qwen3ForCausalLM", {**_COMMON, "num_key_value_heads": 32, "head_dim": 128,
                                         "max_position_embeddings": 32768, **_QWEN_WINDOW}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", {**_COMMON, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                                                "use_sliding_window": False, "sliding_window": 4096,
                                                "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                                                "num_experts_per_tok": 8, "num_local_experts": 128,
                                                "norm_topk_prob": False, "mlp_only_layers": None,
                                                "router_jitter_noise": 0.0},
           aliases={"num_experts": "num_local_experts"}),
    Family("mixtral", "MixtralForCausalLM", {**_COMMON, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                                             "rms_norm_eps": 1e-5, "sliding_window": None, "num_experts_per_tok": 2,
                                             "num_local_experts": 8, "router_jitter_noise": 0.0}, theta=1e6,
           aliases={"num_experts": "num_local_experts"}),
    Family("mistral", "MistralForCausalLM", {**_COMMON, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                                             "sliding_window": 4096}),
    Family("gemma2", "Gemma2ForCausalLM", {**_GEMMA, "max_position_embeddings": 8192,
                                           "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
    Family("gemma3_text", "Gemma3ForCausalLM", {**_GEMMA, "max_position_embeddings": 131072,
                                                "final_logit_softcapping": None, "attn_logit_softcapping": None,
                                                "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
           theta=1e6),
    Family("olmo2", "Olmo2ForCausalLM", {**_COMMON, "rms_norm_eps": 1e-5}),
    Family("phi3", "Phi3ForCausalLM", {**_COMMON, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                                       "original_max_position_embeddings": 4096, "partial_rotary_factor": 1.0,
                                       "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", {
        **_COMMON, "max_position_embeddings": 4096, "num_key_value_heads": 128, "moe_intermediate_size": 2048,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "rope_interleave": True, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
        aliases={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}),
)}
"""Every decoder family we read and write, by ``model_type``."""


class _Reader:
    """One config.json of a family: its keys with ``transformers``' defaults, and one-line refusals."""

    def __init__(self, hf: dict, family: Family, where: str):
        self.raw, self.family, self.where = hf, family, where
        missing = [k for k in SHAPE if k not in hf]
        if missing:
            raise HFError(f"{where}: {missing[0]} is missing; a {family.architecture} config.json gives the "
                               f"model's shape ({', '.join(SHAPE)})")
        self.c = {**family.defaults, **hf}
        for alias, key in family.aliases.items():
            if alias in hf and key not in hf:
                self.c[key] = hf[alias]

    def __getitem__(self, key: str):
        return self.c[key]

    def get(self, key: str, default=None):
        return self.c.get(key, default)

    def require(self, key: str, ok: bool, valid: str) -> None:
        if not ok:
            raise HFError(f"{self.where}: {key}={self.c.get(key)!r} is not supported; {valid}")

    def zero(self, *keys: str) -> None:
        for key in keys:
            self.require(key, not self.c.get(key), "use 0.0 (and our model.dropout for dropout in training)"
                         if "drop" in key else "use false")


def decoder_fields(hf: dict, where: str = "config.json") -> dict[str, Any]:
    """Our ``model.*`` fields for a config.json of one of :data:`FAMILIES` (HFError for one we cannot build)."""
    kind = hf.get("model_type")
    r = _Reader(hf, FAMILIES[kind], where)
    r.zero("attention_dropout", "resid_pdrop", "embd_pdrop")
    d, heads = r["hidden_size"], r["num_attention_heads"]
    head_dim = r.get("head_dim") or d // heads
    from shardwise.config import ModelConfig

    default = ModelConfig()
    fields = {k: getattr(default, k) for k in ARCHITECTURE}  # what the family does not have: our defaults
    fields.update(flavor="llama", hf_model_type=kind, n_layers=r["num_hidden_layers"], d_model=d, n_heads=heads,
                  n_kv_heads=r.get("num_key_value_heads") or heads, head_dim=head_dim, d_ff=r["intermediate_size"],
                  vocab_size=r["vocab_size"], max_seq_len=r["max_position_embeddings"],
                  norm_eps=float(r["rms_norm_eps"]), tie_embeddings=bool(r["tie_word_embeddings"]),
                  n_experts=0, qk_norm=False)
    if kind.startswith("gemma"):
        r.require("hidden_activation", r["hidden_activation"] == "gelu_pytorch_tanh", "use 'gelu_pytorch_tanh'")
    else:
        r.require("hidden_act", r["hidden_act"] == "silu", "use 'silu'")
    if kind != "qwen2":
        r.zero("attention_bias", "mlp_bias")
    fields.update(_rope(r, head_dim))
    fields.update(_SPECIFIC[kind](r, fields))
    return fields


def _rope(r: _Reader, head_dim: int) -> dict[str, Any]:
    """The rotary fields: base, scaling (``rope_scaling`` of transformers 4, ``rope_parameters`` of 5), partial
    rotation; Gemma 3's per-layer-type parameters."""
    params = r.get("rope_scaling") or r.get("rope_parameters") or {}
    local = None
    if "full_attention" in params or "sliding_attention" in params:  # Gemma 3 in transformers 5
        params, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    theta = float(params.get("rope_theta", r.get("rope_theta", r.family.theta)))
    factor = params.get("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    out: dict[str, Any] = {"rope_theta": theta, "rope_scaling": _scaling_text(r, params)}
    if factor != 1.0:
        out["rope_dim"] = int(head_dim * factor)
    if local is not None:
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise HFError(f"{r.where}: rope_parameters.sliding_attention.rope_type="
                               f"{local.get('rope_type')!r} is not supported; the local layers rotate unscaled")
        out["rope_local_theta"] = float(local.get("rope_theta", r.get("rope_local_base_freq", 10000.0)))
    return out


_ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "yarn": ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                       "truncate")}


def _scaling_text(r: _Reader, params: dict) -> str:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return ""
    if kind not in _ROPE_KEYS:
        raise HFError(f"{r.where}: rope_type={kind!r} is not supported; use 'default', 'linear', 'llama3' or "
                           "'yarn' ('dynamic' and 'longrope' change the rotation with each input's length)")
    values = {k: params[k] for k in _ROPE_KEYS[kind] if params.get(k) is not None}
    if kind != "linear":  # transformers: the file's top-level key first (Phi-3), then the block's, then the length
        values["original_max_position_embeddings"] = int(r.raw.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings") or r["max_position_embeddings"])
    if kind == "yarn" and "factor" not in values:
        values["factor"] = r["max_position_embeddings"] / values["original_max_position_embeddings"]
    shown = {k: str(v).lower() if isinstance(v, bool) else repr(float(v)) if k != "original_max_position_embeddings"
             else str(v) for k, v in values.items()}
    return f"{kind}:" + ",".join(f"{k}={v}" for k, v in sorted(shown.items()))


def _no_window(r: _Reader) -> dict:
    layer_types = r.get("layer_types") or []
    r.require("use_sliding_window", not r.get("use_sliding_window") and "sliding_attention" not in layer_types,
              "use false (sliding windows from max_window_layers on are not built)")
    return {}


def _global_every(r: _Reader, default: int) -> int:
    """The k of "every k-th layer global" from ``layer_types`` (or the family's default pattern)."""
    types = r.get("layer_types")
    if not types:
        return default
    n = len(types)
    for k in (default, *range(1, n + 2)):  # the family's own pattern first: the same k as a file without the list
        if types == ["full_attention" if (i + 1) % k == 0 else "sliding_attention" for i in range(n)]:
            return k  # k = n + 1: every layer sliding (Gemma 3 still rotates them by the local base)
    raise HFError(f"{r.where}: layer_types={types!r} is not supported; every k-th layer global (the last of "
                       "each run of k) is what we build")


def _llama(r, f):
    return {}


def _qwen2(r, f):
    return {**_no_window(r), "qkv_bias": True}


def _qwen3(r, f):
    r.zero("attention_bias")
    return {**_no_window(r), "qk_norm": True}


def _mistral(r, f):
    return {"sliding_window": r.get("sliding_window") or 0}


def _gemma(r: _Reader, f: dict, gemma3: bool) -> dict:
    r.require("use_bidirectional_attention", not r.get("use_bidirectional_attention"), "use false (causal)")
    window = r.get("sliding_window") or 0
    out = {"norm_placement": "sandwich", "norm_unit_offset": True, "mlp_activation": "gelu_tanh",
           "embed_scale": True, "attn_scale_dim": float(r["query_pre_attn_scalar"]), "sliding_window": window,
           "final_softcap": float(r.get("final_logit_softcapping") or 0.0)}
    if window:
        out["sliding_global_every"] = _global_every(r, r.get("sliding_window_pattern", 6) if gemma3 else 2)
    if gemma3:
        r.require("attn_logit_softcapping", not r.get("attn_logit_softcapping"),
                  "use null (transformers' Gemma 3 does not apply it)")
        out["qk_norm"] = True
        if not window or not out["sliding_global_every"]:
            f.pop("rope_local_theta", None)
        else:
            out["rope_local_theta"] = f.get("rope_local_theta") or float(r.get("rope_local_base_freq", 10000.0))
    else:
        out["attn_softcap"] = float(r.get("attn_logit_softcapping") or 0.0)
    return out


def _olmo2(r, f):
    return {"norm_placement": "post", "qk_norm": True, "qk_norm_scope": "projection"}


def _phi3(r, f):
    r.require("rope_scaling", not f["rope_scaling"], "use none (transformers' Phi-3 takes only 'longrope', which "
              "changes the rotation with each input's length)")
    return {"sliding_window": r.get("sliding_window") or 0}


def _moe(r: _Reader, f: dict, kind: str) -> dict:
    r.require("router_jitter_noise", not r.get("router_jitter_noise"), "use 0.0 (no router noise)")
    if kind == "mixtral":
        r.require("sliding_window", not r.get("sliding_window"), "use null (our Mixtral has no sliding window)")
        return {"n_experts": r["num_local_experts"], "moe_top_k": r["num_experts_per_tok"], "moe_every": 1,
                "moe_router": "softmax_renorm", "moe_shared": 0}
    _no_window(r)
    r.zero("attention_bias")
    r.require("mlp_only_layers", not r.get("mlp_only_layers"), "use [] (MoE blocks every decoder_sparse_step)")
    return {"qk_norm": True, "n_experts": r["num_local_experts"], "moe_top_k": r["num_experts_per_tok"],
            "moe_every": r["decoder_sparse_step"], "moe_d_ff": r["moe_intermediate_size"], "moe_shared": 0,
            "moe_router": "softmax_renorm" if r["norm_topk_prob"] else "softmax"}


def _deepseek(r: _Reader, f: dict) -> dict:
    r.require("rope_interleave", r["rope_interleave"], "use true (DeepSeek's interleaved rotary layout)")
    r.require("norm_topk_prob", r["norm_topk_prob"], "use true (the chosen scores normalised)")
    r.require("moe_layer_freq", r["moe_layer_freq"] == 1, "use 1 (transformers puts experts in every later layer)")
    r.require("scoring_func", r["scoring_func"] == "sigmoid", "use 'sigmoid'")
    r.require("topk_method", r["topk_method"] == "noaux_tc", "use 'noaux_tc' (the bias-balanced grouped top-k)")
    nope, rope = r["qk_nope_head_dim"], r["qk_rope_head_dim"]
    f.pop("rope_dim", None)
    return {"head_dim": nope + rope, "rope_dim": rope, "v_head_dim": r["v_head_dim"], "n_kv_heads": f["n_heads"],
            "kv_lora_rank": r["kv_lora_rank"], "q_lora_rank": r.get("q_lora_rank") or 0,
            "n_experts": r["n_routed_experts"], "moe_top_k": r["num_experts_per_tok"], "moe_every": 1,
            "moe_dense_first": r["first_k_dense_replace"] or 0, "moe_d_ff": r["moe_intermediate_size"],
            "moe_shared": r["n_shared_experts"] or 0, "moe_router": "sigmoid_bias", "moe_groups": r["n_group"] or 1,
            "moe_group_top_k": r["topk_group"] or 1, "moe_gate_scale": float(r["routed_scaling_factor"])}


_SPECIFIC = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "olmo2": _olmo2, "phi3": _phi3,
             "gemma2": lambda r, f: _gemma(r, f, False), "gemma3_text": lambda r, f: _gemma(r, f, True),
             "mixtral": lambda r, f: _moe(r, f, "mixtral"), "qwen3_moe": lambda r, f: _moe(r, f, "qwen3_moe"),
             "deepseek_v3": _deepseek}
assert set(_SPECIFIC) == set(FAMILIES)


def rope_block(scaling: str, theta: float) -> dict[str, Any]:
    """Our ``model.rope_scaling`` and base as a ``transformers`` rope block (``rope_parameters``)."""
    block: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        kind, _, rest = scaling.partition(":")
        block["rope_type"] = kind
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            block[key] = value == "true" if value in ("true", "false") else (
                int(value) if key == "original_max_position_embeddings" else float(value))
    return block

