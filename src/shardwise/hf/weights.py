"""Our single-process state dict <-> ``transformers`` tensor names and layouts.

GPT-2 (``GPT2LMHeadModel``): the released GPT-2 code keeps its projections as ``Conv1D`` layers whose
weight is ``[in, out]`` (the transpose of ``nn.Linear``) and fuses q, k and v into one ``c_attn``; ours
are separate ``nn.Linear`` layers, so the mapping transposes and concatenates / splits along the output
dimension. Llama (``LlamaForCausalLM``): the same ``nn.Linear`` layouts under other names; the rotary
embedding is the rotate-half layout on both sides, so no permutation of q/k rows is needed.

The mappings are exact (transposes, concatenations and splits only): import then export gives the
same bits. :func:`check_shapes` names every missing tensor or mismatched shape before any conversion.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardwise.hf.config_map import HFError

State = Mapping[str, torch.Tensor]

_LLAMA_BLOCK = {  # ours -> transformers, inside block i
    "norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight", "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight", "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_GPT2_PLAIN = {"norm1": "ln_1", "norm2": "ln_2"}
_GPT2_LINEAR = {"attn.o_proj": "attn.c_proj", "mlp.fc_in": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}


def to_hf(state: State, m) -> dict[str, torch.Tensor]:
    """The ``transformers`` state of our model state ``state`` (fields ``m``); contiguous tensors. A tied
    output head is left out, as ``save_pretrained`` does."""
    out = {"gpt2": _gpt2_to_hf, "llama": _llama_to_hf, "bert": _bert_to_hf}[m.flavor](state, m)
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: State, m) -> dict[str, torch.Tensor]:
    """Our model state (every key of ``Transformer(m).state_dict()``) from a ``transformers`` state."""
    hf = normalized(hf, m)
    return {"gpt2": _gpt2_from_hf, "llama": _llama_from_hf, "bert": _bert_from_hf}[m.flavor](hf, m)


def normalized(hf: Mapping, m) -> dict:
    """Keys as :func:`to_hf` writes them: the base-model checkpoints on the Hub (``GPT2Model``'s
    ``h.0...``, ``LlamaModel``'s ``layers.0...``) lack the ``transformer.`` / ``model.`` prefix, and
    buffers some versions saved (GPT-2's ``attn.bias`` masks, ``rotary_emb.inv_freq``) are dropped."""
    prefix = {"gpt2": "transformer.", "llama": "model.", "bert": "bert."}[m.flavor]
    out = {}
    for key, value in hf.items():
        if key.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "position_ids")):
            continue
        keep = key.startswith((prefix, "cls.", "classifier.")) or key == "lm_head.weight"
        out[key if keep else prefix + key] = value
    return out


def expected_shapes(m) -> dict[str, tuple[int, ...]]:
    """The shape of every ``transformers`` tensor of a model with fields ``m`` (from a meta-device model)."""
    from shardwise.model import Transformer

    with torch.device("meta"):
        state = Transformer(m).state_dict()
    return {k: tuple(v.shape) for k, v in to_hf(state, m).items()}


def check_shapes(hf_shapes: Mapping[str, tuple[int, ...]], m, where: str) -> None:
    """HFError naming the first tensor that is missing, or whose shape differs from what ``config.json``
    implies (both shapes), or that the mapping does not know."""
    expected = expected_shapes(m)
    given = normalized(hf_shapes, m)
    names = set(given)
    for key, shape in expected.items():
        if key not in names:
            raise HFError(f"{where}: tensor {key} is missing (expected shape {list(shape)})")
        if tuple(given[key]) != shape:
            raise HFError(f"{where}: tensor {key} has shape {list(given[key])}, but config.json implies "
                          f"{list(shape)}")
    unknown = sorted(names - set(expected) - {"lm_head.weight", "cls.predictions.decoder.weight",
                                              "cls.predictions.decoder.bias"})
    if unknown:
        raise HFError(f"{where}: tensor {unknown[0]} is not part of a {m.flavor} model with this config.json "
                      f"({len(unknown)} unknown tensors)")


def _gpt2_to_hf(s: State, m) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": s["tok_emb.weight"], "transformer.wpe.weight": s["pos_emb.weight"],
           "transformer.ln_f.weight": s["norm_f.weight"], "transformer.ln_f.bias": s["norm_f.bias"]}
    for i in range(m.n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in _GPT2_PLAIN.items():
            for t in ("weight", "bias"):
                out[f"{theirs}{b}.{t}"] = s[f"{ours}{a}.{t}"]
        qkv = [f"{ours}attn.{p}_proj" for p in "qkv"]
        out[f"{theirs}attn.c_attn.weight"] = torch.cat([s[f"{n}.weight"] for n in qkv], 0).t()
        out[f"{theirs}attn.c_attn.bias"] = torch.cat([s[f"{n}.bias"] for n in qkv], 0)
        for a, b in _GPT2_LINEAR.items():
            out[f"{theirs}{b}.weight"] = s[f"{ours}{a}.weight"].t()
            out[f"{theirs}{b}.bias"] = s[f"{ours}{a}.bias"]
    if not m.tie_embeddings:
        out["lm_head.weight"] = s["lm_head.weight"]
    return out


def _gpt2_from_hf(h: State, m) -> dict[str, torch.Tensor]:
    out = {"tok_emb.weight": h["transformer.wte.weight"], "pos_emb.weight": h["transformer.wpe.weight"],
           "norm_f.weight": h["transformer.ln_f.weight"], "norm_f.bias": h["transformer.ln_f.bias"]}
    for i in range(m.n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in _GPT2_PLAIN.items():
            for t in ("weight", "bias"):
                out[f"{ours}{a}.{t}"] = h[f"{theirs}{b}.{t}"]
        weights = h[f"{theirs}attn.c_attn.weight"].t().split(m.d_model, 0)
        biases = h[f"{theirs}attn.c_attn.bias"].split(m.d_model, 0)
        for p, w, b in zip("qkv", weights, biases, strict=True):
            out[f"{ours}attn.{p}_proj.weight"] = w.contiguous()
            out[f"{ours}attn.{p}_proj.bias"] = b.contiguous()
        for a, b in _GPT2_LINEAR.items():
            out[f"{ours}{a}.weight"] = h[f"{theirs}{b}.weight"].t().contiguous()
            out[f"{ours}{a}.bias"] = h[f"{theirs}{b}.bias"]
    out["lm_head.weight"] = out["tok_emb.weight"] if m.tie_embeddings else h["lm_head.weight"]
    return out


def _llama_to_hf(s: State, m) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": s["tok_emb.weight"], "model.norm.weight": s["norm_f.weight"]}
    for i in range(m.n_layers):
        for a, b in _LLAMA_BLOCK.items():
            out[f"model.layers.{i}.{b}"] = s[f"blocks.{i}.{a}"]
    if not m.tie_embeddings:
        out["lm_head.weight"] = s["lm_head.weight"]
    return out


def _llama_from_hf(h: State, m) -> dict[str, torch.Tensor]:
    out = {"tok_emb.weight": h["model.embed_tokens.weight"], "norm_f.weight": h["model.norm.weight"]}
    for i in range(m.n_layers):
        for a, b in _LLAMA_BLOCK.items():
            out[f"blocks.{i}.{a}"] = h[f"model.layers.{i}.{b}"]
    out["lm_head.weight"] = out["tok_emb.weight"] if m.tie_embeddings else h["lm_head.weight"]
    return out


_BERT_BLOCK = {  # ours -> transformers, inside layer i (weight and bias each)
    "attn.q_proj": "attention.self.query", "attn.k_proj": "attention.self.key", "attn.v_proj": "attention.self.value",
    "attn.o_proj": "attention.output.dense", "norm1": "attention.output.LayerNorm",
    "mlp.fc_in": "intermediate.dense", "mlp.fc_out": "output.dense", "norm2": "output.LayerNorm",
}
_BERT_TOP = {  # ours -> transformers, outside the layers
    "tok_emb.weight": "bert.embeddings.word_embeddings.weight",
    "pos_emb.weight": "bert.embeddings.position_embeddings.weight",
    "type_emb.weight": "bert.embeddings.token_type_embeddings.weight",
    "emb_norm.weight": "bert.embeddings.LayerNorm.weight", "emb_norm.bias": "bert.embeddings.LayerNorm.bias",
}
_BERT_MLM = {
    "mlm_dense.weight": "cls.predictions.transform.dense.weight",
    "mlm_dense.bias": "cls.predictions.transform.dense.bias",
    "norm_f.weight": "cls.predictions.transform.LayerNorm.weight",
    "norm_f.bias": "cls.predictions.transform.LayerNorm.bias",
    "lm_head.bias": "cls.predictions.bias",
}


_BERT_CLASSIFIER = {"pooler.weight": "bert.pooler.dense.weight", "pooler.bias": "bert.pooler.dense.bias",
                    "classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}


def _bert_names(m) -> dict[str, str]:
    names = {**_BERT_TOP, **(_BERT_CLASSIFIER if m.n_classes else _BERT_MLM)}
    for i in range(m.n_layers):
        for a, b in _BERT_BLOCK.items():
            for t in ("weight", "bias"):
                names[f"blocks.{i}.{a}.{t}"] = f"bert.encoder.layer.{i}.{b}.{t}"
    if not m.tie_embeddings and not m.n_classes:
        names["lm_head.weight"] = "cls.predictions.decoder.weight"
    return names


def _bert_to_hf(s: State, m) -> dict[str, torch.Tensor]:
    return {theirs: s[ours] for ours, theirs in _bert_names(m).items()}


def _bert_from_hf(h: State, m) -> dict[str, torch.Tensor]:
    out = {ours: h[theirs] for ours, theirs in _bert_names(m).items()}
    if m.tie_embeddings and not m.n_classes:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out
