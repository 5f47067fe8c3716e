"""Our model fields <-> a ``transformers`` ``config.json``, for the architectures we can map exactly.

Pure Python (no torch), so :mod:`shardwise.config_resolve` can read an ``hf:PATH`` directory's shape
before any worker starts.

* ``gpt2`` <-> ``GPT2LMHeadModel`` (model_type "gpt2"): our GPT-2 flavour is the GPT-2 of Radford et al.
  2019 with the tanh GELU, i.e. ``activation_function = "gelu_new"``.
* ``llama`` <-> ``LlamaForCausalLM`` (model_type "llama"): RMSNorm, SwiGLU, rotary positions in the
  rotate-half layout (the layout of the ``transformers`` Llama checkpoints), grouped-query attention,
  no biases.
* ``bert`` <-> ``BertForMaskedLM`` (model_type "bert"): post-norm encoder, exact GELU (``hidden_act = "gelu"``),
  absolute positions, two token types, the masked-LM head tied to the word embeddings; with
  ``model.n_classes`` <-> ``BertForSequenceClassification`` (pooler and classifier instead of the head).
* ``llama`` with experts <-> ``MixtralForCausalLM`` (model_type "mixtral"; Jiang et al. 2024): every block
  MoE, the ``softmax_renorm`` router, no shared experts, experts as wide as ``intermediate_size``;
* ``llama`` with experts and QK-norm <-> ``Qwen3MoeForCausalLM`` (model_type "qwen3_moe"): ``decoder_sparse_step``
  is ``moe_every``, ``moe_intermediate_size`` the experts' width (``moe_d_ff``), ``norm_topk_prob`` picks
  ``softmax_renorm`` over ``softmax``; no shared experts. Neither has the ``sigmoid_bias`` router.

Anything else (another ``model_type``, rope scaling, biases in Llama, another activation) is refused with
one line naming the key, its value and what we accept -- a silently different model would be worse. A key a
``config.json`` leaves out means what ``transformers``' config class of that family assumes
(:data:`HF_DEFAULTS`), except the keys that fix the model's size (:data:`HF_REQUIRED`), whose absence is refused
in one line: ``transformers`` would assume another model's size there. A new family adds its rows to both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HF_PREFIX = "hf:"
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}
"""Our flavour -> the ``transformers`` class an exported directory is loaded with."""
MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""The ``transformers`` MoE model_type -> class (llama flavour with experts)."""
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""The tanh approximation of GELU under its two ``transformers`` names (our GeluMLP)."""

_LLAMA_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings")
HF_REQUIRED: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"),
    "llama": _LLAMA_SIZES,
    "mixtral": (*_LLAMA_SIZES, "num_local_experts", "num_experts_per_tok"),
    "qwen3_moe": (*_LLAMA_SIZES, "num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "bert": _LLAMA_SIZES,
}
"""Per ``model_type``: the keys that fix the model's size. A config.json without one is refused, naming it."""
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_inner": None, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
             "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False},
    "llama": {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
    "mixtral": {"num_key_value_heads": 8, "head_dim": None, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "hidden_act": "silu", "tie_word_embeddings": False, "sliding_window": None,
                "router_jitter_noise": 0.0},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                  "sliding_window": None, "use_sliding_window": False, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "bert": {"hidden_act": "gelu", "type_vocab_size": 2, "position_embedding_type": "absolute",
             "layer_norm_eps": 1e-12, "tie_word_embeddings": True},
}
"""Per ``model_type``: what ``transformers``' config class assumes for each optional key we read, where a
config.json leaves it out (or null). ``None`` means the class derives it: Llama's key/value heads are its heads,
``head_dim`` is hidden_size / heads, GPT-2's ``n_inner`` is 4 x n_embd. tests/test_hf.py holds every family's
import of a config.json with only the required keys against ``transformers``' own reading of it."""
HF_ALIASES: dict[str, dict[str, str]] = {"mixtral": {"num_experts": "num_local_experts"},
                                         "qwen3_moe": {"num_local_experts": "num_experts"}}
"""Per ``model_type``: another name ``transformers`` accepts (and may write) for a key we read (its config class's
``attribute_map``)."""


class HFError(ValueError):
    """An HF directory we cannot map: the message is one line naming the file, key and value."""


def hf_path(init_from: str) -> Path:
    """The directory of ``model.init_from = "hf:PATH"``."""
    if not init_from.startswith(HF_PREFIX):
        raise HFError("not a source we read; use 'hf:PATH' (a transformers model directory)")
    return Path(init_from[len(HF_PREFIX):]).expanduser()


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFError(f"{directory} is not a transformers model directory (no config.json)")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HFError(f"{path} is not valid JSON: {e}") from None


def with_defaults(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``hf`` with ``transformers``' default for every optional key it leaves out or sets to null
    (:data:`HF_DEFAULTS`); HFError, naming the key, for a missing one that fixes the model's size."""
    kind = hf.get("model_type")
    given = {HF_ALIASES.get(kind, {}).get(k, k): v for k, v in hf.items() if v is not None}
    for key in HF_REQUIRED.get(kind, ()):
        if key not in given:
            raise HFError(f"{where}: {key} is missing; a {kind} config.json must give it (it fixes the model's "
                          "size: transformers would assume its default model's)")
    return {**HF_DEFAULTS.get(kind, {}), **given}


def model_fields(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our ``model.*`` fields for a ``transformers`` config (HFError for one we cannot map exactly); a key it leaves
    out means what ``transformers`` assumes (:func:`with_defaults`)."""
    hf = with_defaults(hf, where)
    kind = hf.get("model_type")
    if kind == "gpt2":
        return _gpt2_fields(hf, where)
    if kind == "llama":
        return _llama_fields(hf, where)
    if kind == "bert":
        return _bert_fields(hf, where)
    if kind in MOE_ARCHITECTURES:
        return _moe_fields(hf, where)
    archs = hf.get("architectures")
    names = [*ARCHITECTURES.values(), *MOE_ARCHITECTURES.values()]
    raise HFError(f"{where}: model_type={kind!r} (architectures {archs}) is not supported; "
                  f"use a {' / '.join(names)} directory (model_type 'gpt2', 'llama', 'bert', 'mixtral' or "
                  "'qwen3_moe')")


def _require(hf: dict, key: str, ok: bool, valid: str, where: str) -> None:
    if not ok:
        raise HFError(f"{where}: {key}={hf.get(key)!r} is not supported; {valid}")


def _gpt2_fields(hf: dict, where: str) -> dict[str, Any]:
    act = hf["activation_function"]
    _require(hf, "activation_function", act in GPT2_ACTIVATIONS, f"use one of {GPT2_ACTIVATIONS}", where)
    _require(hf, "scale_attn_weights", hf["scale_attn_weights"], "use true", where)
    _require(hf, "scale_attn_by_inverse_layer_idx", not hf["scale_attn_by_inverse_layer_idx"], "use false", where)
    d = hf["n_embd"]
    return dict(flavor="gpt2", n_layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"], n_kv_heads=hf["n_head"],
                d_ff=hf.get("n_inner") or 4 * d, vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                norm_eps=float(hf["layer_norm_epsilon"]), tie_embeddings=bool(hf["tie_word_embeddings"]))


def rope_theta_of(hf: dict, where: str = "config.json") -> float:
    """The rotary base: ``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (transformers 5);
    any rope scaling is refused (our rotary embedding has none). (``hf`` with its family's defaults: a missing
    base is the family's, :data:`HF_DEFAULTS`.)"""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for key, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind != "default":
            raise HFError(f"{where}: {key}.rope_type={kind!r} is not supported; only 'default' rotary embeddings")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_fields(hf: dict, where: str) -> dict[str, Any]:
    for key in ("attention_bias", "mlp_bias"):
        _require(hf, key, not hf.get(key, False), "use false (our llama flavour has no biases)", where)
    _require(hf, "hidden_act", hf["hidden_act"] == "silu", "use 'silu'", where)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    _require(hf, "head_dim", head_dim * heads == d, f"use hidden_size / num_attention_heads = {d // heads}", where)
    return dict(flavor="llama", n_layers=hf["num_hidden_layers"], d_model=d, n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads, d_ff=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
                norm_eps=float(hf["rms_norm_eps"]), rope_theta=rope_theta_of(hf, where),
                tie_embeddings=bool(hf["tie_word_embeddings"]))


def _moe_fields(hf: dict, where: str) -> dict[str, Any]:
    """Mixtral and Qwen3-MoE: Llama's attention (Qwen3 with QK-norm) and dropless top-k experts."""
    kind = hf["model_type"]
    fields = _llama_fields({**hf, "mlp_bias": False}, where)
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", kind == "mixtral"):
        _require(hf, "sliding_window", False, "use null (our attention has no sliding window)", where)
    _require(hf, "router_jitter_noise", not hf.get("router_jitter_noise"), "use 0.0 (no router noise)", where)
    experts = hf["num_local_experts" if kind == "mixtral" else "num_experts"]
    fields.update(n_experts=experts, moe_top_k=hf["num_experts_per_tok"], moe_shared=0)
    if kind == "mixtral":
        return {**fields, "moe_every": 1, "moe_router": "softmax_renorm", "moe_d_ff": None, "qk_norm": False}
    _require(hf, "mlp_only_layers", not hf.get("mlp_only_layers"), "use [] (MoE blocks every decoder_sparse_step)",
             where)
    return {**fields, "moe_every": hf["decoder_sparse_step"], "qk_norm": True,
            "moe_router": "softmax_renorm" if hf["norm_topk_prob"] else "softmax",
            "moe_d_ff": hf["moe_intermediate_size"]}


def _bert_fields(hf: dict, where: str) -> dict[str, Any]:
    _require(hf, "hidden_act", hf["hidden_act"] == "gelu", "use 'gelu' (the exact GELU)", where)
    _require(hf, "type_vocab_size", hf["type_vocab_size"] == 2, "use 2", where)
    _require(hf, "position_embedding_type", hf["position_embedding_type"] == "absolute", "use 'absolute'", where)
    classifier = "BertForSequenceClassification" in (hf.get("architectures") or [])
    n_classes = len(hf.get("id2label") or {}) or hf.get("num_labels", 2) if classifier else 0
    return dict(flavor="bert", n_classes=n_classes, n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"],
                n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
                norm_eps=float(hf["layer_norm_eps"]), tie_embeddings=bool(hf["tie_word_embeddings"]))


def hf_config(m, eos_id: int | None = None, bos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of a model with our resolved fields ``m`` (a ModelConfig), weights in ``dtype``
    (a torch dtype name); HFError, one line, for a model no ``transformers`` class expresses."""
    common = {"architectures": [ARCHITECTURES[m.flavor]], "model_type": m.flavor, "vocab_size": m.vocab_size,
              "tie_word_embeddings": bool(m.tie_embeddings), "torch_dtype": dtype,
              "bos_token_id": bos_id if bos_id is not None else eos_id, "eos_token_id": eos_id}
    if getattr(m, "n_experts", 0):
        return _moe_config(m, common)
    if m.flavor == "gpt2":
        return {**common, "n_layer": m.n_layers, "n_embd": m.d_model, "n_head": m.n_heads, "n_inner": m.d_ff,
                "n_positions": m.max_seq_len, "n_ctx": m.max_seq_len, "layer_norm_epsilon": m.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
                "attn_pdrop": m.dropout, "scale_attn_weights": True, "use_cache": True}
    if m.flavor == "llama":
        return {**common, "num_hidden_layers": m.n_layers, "hidden_size": m.d_model,
                "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
                "head_dim": m.d_model // m.n_heads, "intermediate_size": m.d_ff,
                "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "attention_dropout": m.dropout, "use_cache": True}
    if m.flavor == "bert":
        if m.n_classes:  # the [CLS] classifier instead of the masked-LM head
            common = {**common, "architectures": ["BertForSequenceClassification"],
                      "id2label": {str(i): f"LABEL_{i}" for i in range(m.n_classes)},
                      "label2id": {f"LABEL_{i}": i for i in range(m.n_classes)}, "classifier_dropout": None}
        return {**common, "num_hidden_layers": m.n_layers, "hidden_size": m.d_model,
                "num_attention_heads": m.n_heads, "intermediate_size": m.d_ff, "hidden_act": "gelu",
                "max_position_embeddings": m.max_seq_len, "type_vocab_size": 2, "layer_norm_eps": m.norm_eps,
                "hidden_dropout_prob": m.dropout, "attention_probs_dropout_prob": m.dropout,
                "position_embedding_type": "absolute", "pad_token_id": None, "is_decoder": False}
    raise HFError(f"model.flavor={m.flavor!r} has no transformers export; use one of {tuple(ARCHITECTURES)}")


def _moe_config(m, common: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's or Qwen3-MoE's config.json (see the module docstring for which fits which model)."""
    def refuse(what: str) -> HFError:
        return HFError(f"{what}: no transformers MoE class we export to (MixtralForCausalLM, Qwen3MoeForCausalLM) "
                       "has it; export a model without it")

    if m.flavor != "llama":
        raise refuse(f"model.flavor={m.flavor!r} with model.n_experts={m.n_experts}: GELU experts")
    if m.moe_shared:
        raise refuse(f"model.moe_shared={m.moe_shared}: shared experts")
    if m.moe_router == "sigmoid_bias":
        raise refuse("model.moe_router='sigmoid_bias': the biased sigmoid router (DeepSeek-V3's, whose "
                     "transformers class needs multi-head latent attention)")
    llama = hf_config(_dense(m), common["eos_token_id"], common["bos_token_id"], common["torch_dtype"])
    moe = {**llama, "num_experts_per_tok": m.moe_top_k, "router_aux_loss_coef": m.moe_aux_coeff,
           "output_router_logits": False, "sliding_window": None}
    for key in ("attention_bias", "mlp_bias"):
        moe.pop(key)
    if not getattr(m, "qk_norm", False):
        if m.moe_every != 1 or (m.moe_d_ff or m.d_ff) != m.d_ff or m.moe_router != "softmax_renorm":
            raise HFError(f"model.moe_every={m.moe_every}, model.moe_d_ff={m.moe_d_ff}, model.moe_router="
                          f"{m.moe_router!r} without model.qk_norm: Mixtral needs moe_every 1, moe_d_ff = d_ff and "
                          "'softmax_renorm' (Qwen3-MoE, which has the others, needs model.qk_norm=true)")
        return {**moe, "architectures": [MOE_ARCHITECTURES["mixtral"]], "model_type": "mixtral",
                "num_local_experts": m.n_experts, "router_jitter_noise": 0.0}
    return {**moe, "architectures": [MOE_ARCHITECTURES["qwen3_moe"]], "model_type": "qwen3_moe",
            "num_experts": m.n_experts, "moe_intermediate_size": m.moe_d_ff or m.d_ff,
            "decoder_sparse_step": m.moe_every, "mlp_only_layers": [], "attention_bias": False,
            "norm_topk_prob": m.moe_router == "softmax_renorm", "use_sliding_window": False}


def _dense(m):
    """``m`` without its experts (for the fields a MoE config shares with Llama's)."""
    import dataclasses

    return dataclasses.replace(m, n_experts=0) if dataclasses.is_dataclass(m) else m
