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
    names, transposed = _names(m)
    out = {theirs: state[ours].t() if ours in transposed else state[ours] for ours, theirs in names.items()}
    if m.flavor == "gpt2":
        out.update(_gpt2_qkv_to_hf(state, m))
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: State, m) -> dict[str, torch.Tensor]:
    """Our model state (every key of ``Transformer(m).state_dict()``) from a ``transformers`` state."""
    hf = normalized(hf, m)
    names, transposed = _names(m)
    out = {ours: hf[theirs].t().contiguous() if ours in transposed else hf[theirs] for ours, theirs in names.items()}
    if m.flavor == "gpt2":
        out.update(_gpt2_qkv_from_hf(hf, m))
    if m.tie_embeddings and not m.n_classes:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out


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


def _names(m) -> tuple[dict[str, str], set[str]]:
    """Our name -> the ``transformers`` name of every tensor that is only renamed (one table serves both
    directions), and which of ours are stored transposed there (GPT-2's ``Conv1D``). GPT-2's fused
    ``c_attn`` is not in it (:func:`_gpt2_qkv_to_hf`); an untied output head is."""
    names, transposed = {}, set()
    if m.flavor == "bert":
        names = {**_BERT_TOP, **(_BERT_CLASSIFIER if m.n_classes else _BERT_MLM)}
        for i in range(m.n_layers):
            for a, b in _BERT_BLOCK.items():
                for t in ("weight", "bias"):
                    names[f"blocks.{i}.{a}.{t}"] = f"bert.encoder.layer.{i}.{b}.{t}"
        if not m.tie_embeddings and not m.n_classes:
            names["lm_head.weight"] = "cls.predictions.decoder.weight"
        return names, transposed
    if m.flavor == "llama":
        names = {"tok_emb.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight"}
        for i in range(m.n_layers):
            for a, b in _LLAMA_BLOCK.items():
                names[f"blocks.{i}.{a}"] = f"model.layers.{i}.{b}"
    else:
        names = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
                 "norm_f.weight": "transformer.ln_f.weight", "norm_f.bias": "transformer.ln_f.bias"}
        for i in range(m.n_layers):
            ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
            for table in (_GPT2_PLAIN, _GPT2_LINEAR):
                for a, b in table.items():
                    for t in ("weight", "bias"):
                        names[f"{ours}{a}.{t}"] = f"{theirs}{b}.{t}"
            transposed |= {f"{ours}{a}.weight" for a in _GPT2_LINEAR}
    if not m.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names, transposed


def _gpt2_qkv_to_hf(s: State, m) -> dict[str, torch.Tensor]:
    """GPT-2's fused ``c_attn`` (``Conv1D``: ``[in, 3 out]``) from our q, k and v projections."""
    out = {}
    for i in range(m.n_layers):
        qkv = [f"blocks.{i}.attn.{p}_proj" for p in "qkv"]
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([s[f"{n}.weight"] for n in qkv], 0).t()
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([s[f"{n}.bias"] for n in qkv], 0)
    return out


def _gpt2_qkv_from_hf(h: State, m) -> dict[str, torch.Tensor]:
    """Our q, k and v projections from GPT-2's fused ``c_attn``."""
    out = {}
    for i in range(m.n_layers):
        theirs = f"transformer.h.{i}.attn.c_attn"
        weights = h[f"{theirs}.weight"].t().split(m.d_model, 0)
        biases = h[f"{theirs}.bias"].split(m.d_model, 0)
        for p, w, b in zip("qkv", weights, biases, strict=True):
            out[f"blocks.{i}.attn.{p}_proj.weight"] = w.contiguous()
            out[f"blocks.{i}.attn.{p}_proj.bias"] = b.contiguous()
    return out
