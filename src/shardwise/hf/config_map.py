"""Our model fields <-> a ``transformers`` ``config.json``, for the architectures we can map exactly.

Pure Python (no torch), so :mod:`shardwise.config_resolve` can read an ``hf:PATH`` directory's shape
before any worker starts.

* ``gpt2`` <-> ``GPT2LMHeadModel`` (model_type "gpt2"): our GPT-2 flavour is the GPT-2 of Radford et al.
  2019 with the tanh GELU, i.e. ``activation_function = "gelu_new"``.
* ``llama`` <-> the decoder families of :mod:`shardwise.hf.decoders` (Llama 3.x, Qwen2/3, Qwen3-MoE, Mixtral,
  Mistral, Gemma 2/3, OLMo 2, Phi-3, DeepSeek-V3): read there, written by :mod:`shardwise.hf.decoder_config`.
* ``bert`` <-> ``BertForMaskedLM`` (model_type "bert"): post-norm encoder, exact GELU (``hidden_act = "gelu"``),
  absolute positions, two token types, the masked-LM head tied to the word embeddings; with
  ``model.n_classes`` <-> ``BertForSequenceClassification`` (pooler and classifier instead of the head).
Anything else (another ``model_type``, a rotary scaling we do not build, another activation) is refused with
one line naming the key, its value and what we accept -- a silently different model would be worse. A key
a ``config.json`` leaves out means what ``transformers``' config class of that family assumes
(:data:`HF_DEFAULTS`; the decoder families' rows are :data:`shardwise.hf.decoders.FAMILIES`), except the keys
that fix the model's size (:data:`HF_REQUIRED`), whose absence is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.hf.decoder_config import decoder_config
from shardwise.hf.decoders import FAMILIES, SHAPE, HFError, decoder_fields

HF_PREFIX = "hf:"
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}
"""Our flavour -> the ``transformers`` class an exported directory is loaded with."""
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""The tanh approximation of GELU under its two ``transformers`` names (our GeluMLP)."""

_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
          "max_position_embeddings")
HF_REQUIRED: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"),
    "bert": _SIZES,
    **{kind: SHAPE for kind in FAMILIES},
}
"""Per ``model_type``: the keys that fix the model's size. A config.json without one is refused, naming it (the
decoder families' check is :class:`shardwise.hf.decoders.Family`'s reader)."""
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_inner": None, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
             "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False},
    "bert": {"hidden_act": "gelu", "type_vocab_size": 2, "position_embedding_type": "absolute",
             "layer_norm_eps": 1e-12, "tie_word_embeddings": True},
    **{kind: family.defaults for kind, family in FAMILIES.items()},
}
"""Per ``model_type``: what ``transformers``' config class assumes for each optional key we read, where a
config.json leaves it out (or null, for GPT-2 and BERT; a decoder family's null can mean "none", e.g. Mistral's
``sliding_window``). ``None`` means the class derives it: GPT-2's ``n_inner`` is 4 x n_embd, Llama's key/value
heads are its heads. tests/test_hf_config_defaults.py holds every family's import of a config.json with only the
required keys against ``transformers``' own reading of it."""


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
    if kind in FAMILIES:  # the decoder families' reader applies their rows (a null there can mean "none")
        return hf
    given = {k: v for k, v in hf.items() if v is not None}
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
    if kind == "bert":
        return _bert_fields(hf, where)
    if kind in FAMILIES:
        return decoder_fields(hf, where)
    if kind == "gemma3":  # Gemma 3's image-text checkpoints: the language model's text_config (its vision tower left)
        text = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **(hf.get("text_config") or {}),
                "model_type": "gemma3_text"}
        _require(text, "final_logit_softcapping", not text.get("final_logit_softcapping"),
                 "use null (transformers' Gemma3ForConditionalGeneration does not apply it)", f"{where} text_config")
        return decoder_fields(text, f"{where} text_config")
    archs = hf.get("architectures")
    raise HFError(f"{where}: model_type={kind!r} (architectures {archs}) is not supported; use one of "
                  f"{', '.join(map(repr, ('gpt2', 'bert', *FAMILIES, 'gemma3')))}")


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
    if m.flavor != "llama" and getattr(m, "n_experts", 0):  # GPT2LMHeadModel / BertForMaskedLM: dense MLPs only
        raise HFError(f"model.flavor={m.flavor!r} with model.n_experts={m.n_experts}: transformers' "
                      f"{ARCHITECTURES[m.flavor]} has no experts (its MLPs would load as random weights); export a "
                      "llama-flavour MoE (Mixtral, Qwen3-MoE, DeepSeek-V3) or a model without experts")
    if m.flavor == "gpt2":
        return {**common, "n_layer": m.n_layers, "n_embd": m.d_model, "n_head": m.n_heads, "n_inner": m.d_ff,
                "n_positions": m.max_seq_len, "n_ctx": m.max_seq_len, "layer_norm_epsilon": m.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
                "attn_pdrop": m.dropout, "scale_attn_weights": True, "use_cache": True}
    if m.flavor == "llama":
        return decoder_config(m, common)
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
