"""Which ``transformers`` tensors make each tensor of our single-process state: one table serves import and export.

Every tensor of ours is a :class:`Recipe`: one :class:`Part` of one ``transformers`` tensor (renamed, possibly
transposed, possibly a block of rows of a fused tensor), or a stack of parts along a new first dim (the
experts of an MoE block, which ``transformers`` checkpoints keep one tensor per expert). Reading a recipe takes
an *index* of our tensor (one slice per dim) and turns it into the index of each ``transformers`` tensor it
touches, so a rank can read exactly the rows or elements it holds from safetensors (``get_slice``) without
the rest (:mod:`shardwise.hf.lazy`); export runs the same table backwards (:func:`hf_layout`), so import then
export gives the same bits.

The mappings, per architecture:

* GPT-2 (``GPT2LMHeadModel``): the released code's ``Conv1D`` weights are ``[in, out]``, the transpose of our
  ``nn.Linear``; q, k and v are one fused ``c_attn`` (``[in, 3 out]``), of which each of ours is a column block;
* Llama (``LlamaForCausalLM``) and BERT (``BertForMaskedLM`` / ``...ForSequenceClassification``): renames;
* Mixtral (``MixtralForCausalLM``): Llama's names, ``block_sparse_moe.gate`` for the router and per expert
  ``w1`` (gate), ``w3`` (up), ``w2`` (down) -- the Hub layout ``save_pretrained`` writes; the fused layout
  ``transformers`` 5 can also write (``mlp.experts.gate_up_proj [E, 2 ff, d]``, ``down_proj``) is read too;
* Qwen3-MoE (``Qwen3MoeForCausalLM``): Llama's names plus ``self_attn.{q,k}_norm``, ``mlp.gate`` and
  ``mlp.experts.<j>.{gate,up,down}_proj`` (or the fused layout), dense ``mlp.*`` in the blocks without experts.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """Our tensor (or one expert of it) as ``transformers`` tensor ``name``: rows ``[start, stop)`` along ``dim``
    of it (all of it when ``dim`` is None), transposed (2-d) when ``transposed``."""

    name: str
    transposed: bool = False
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class Recipe:
    """One of our tensors: ``parts[0]`` itself, or (``stacked``) the parts stacked along a new dim 0.
    ``alias``: the same values as another of our tensors (a tied output head) -- read, never written."""

    parts: tuple[Part, ...]
    stacked: bool = False
    alias: bool = False


def moe_kind(m) -> str | None:
    """The ``transformers`` MoE layout of our fields ``m``: "qwen3_moe" (with QK-norm), "mixtral" or None (dense);
    whether the other fields fit it is :func:`shardwise.hf.config_map.hf_config`'s to say."""
    if not getattr(m, "n_experts", 0):
        return None
    return "qwen3_moe" if getattr(m, "qk_norm", False) else "mixtral"


def recipes(m, names: Collection[str] | None = None) -> dict[str, Recipe]:
    """Our state-dict key -> its recipe, for a model with fields ``m``. ``names``: the (normalised) tensor names
    of a directory being read, to pick between the per-expert and the fused expert layouts (None: per expert,
    the layout we write)."""
    if m.flavor == "bert":
        return {ours: Recipe((Part(theirs),)) for ours, theirs in _bert_names(m).items()}
    if m.flavor == "gpt2":
        return _gpt2(m)
    out = {"tok_emb.weight": Recipe((Part("model.embed_tokens.weight"),)),
           "norm_f.weight": Recipe((Part("model.norm.weight"),))}
    out["lm_head.weight"] = Recipe((Part("model.embed_tokens.weight"),), alias=True) if m.tie_embeddings \
        else Recipe((Part("lm_head.weight"),))
    kind = moe_kind(m)
    for i in range(m.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in _LLAMA_BLOCK.items():
            out[ours + a] = Recipe((Part(theirs + b),))
        if getattr(m, "qk_norm", False):
            for q in "qk":
                out[f"{ours}attn.{q}_norm.weight"] = Recipe((Part(f"{theirs}self_attn.{q}_norm.weight"),))
        from shardwise.model.moe import is_moe_layer

        if not is_moe_layer(i, m.n_experts or 0, m.moe_every):
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ours}mlp.{p}.weight"] = Recipe((Part(f"{theirs}mlp.{p}.weight"),))
            continue
        moe = theirs + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
        fused = {f"{theirs}mlp.experts.gate_up_proj", f"{moe}experts.gate_up_proj"} & set(names or ())
        if fused:
            moe = f"{theirs}mlp."  # transformers 5's fused layout renames Mixtral's block_sparse_moe too
        out[f"{ours}mlp.router.weight"] = Recipe((Part(f"{moe}gate.weight"),))
        out.update(_experts(m, ours, moe, kind, bool(fused)))
    return out


_LLAMA_BLOCK = {  # ours -> transformers, inside block i
    "norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight", "attn.o_proj.weight": "self_attn.o_proj.weight",
}
_EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                 "qwen3_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}}


def _experts(m, ours: str, moe: str, kind: str, fused: bool) -> dict[str, Recipe]:
    """Our stacked ``experts.{gate,up,down}_proj.weight`` from one tensor per expert, or from the fused
    ``gate_up_proj [E, 2 ff, d]`` (gate rows first) and ``down_proj [E, d, ff]``."""
    out = {}
    ff = m.moe_d_ff or m.d_ff
    for p, name in _EXPERT_NAMES[kind].items():
        key = f"{ours}mlp.experts.{p}.weight"
        if fused:
            part = Part(f"{moe}experts.down_proj") if p == "down_proj" else \
                Part(f"{moe}experts.gate_up_proj", dim=1, start=0 if p == "gate_proj" else ff,
                     stop=ff if p == "gate_proj" else 2 * ff)
            out[key] = Recipe((part,))
        else:
            out[key] = Recipe(tuple(Part(f"{moe}experts.{j}.{name}.weight") for j in range(m.n_experts)),
                              stacked=True)
    return out


_GPT2_PLAIN = {"norm1": "ln_1", "norm2": "ln_2"}
_GPT2_LINEAR = {"attn.o_proj": "attn.c_proj", "mlp.fc_in": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}


def _gpt2(m) -> dict[str, Recipe]:
    out = {"tok_emb.weight": Recipe((Part("transformer.wte.weight"),)),
           "pos_emb.weight": Recipe((Part("transformer.wpe.weight"),)),
           "norm_f.weight": Recipe((Part("transformer.ln_f.weight"),)),
           "norm_f.bias": Recipe((Part("transformer.ln_f.bias"),))}
    out["lm_head.weight"] = Recipe((Part("transformer.wte.weight"),), alias=True) if m.tie_embeddings \
        else Recipe((Part("lm_head.weight"),))
    d = m.d_model
    for i in range(m.n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in _GPT2_PLAIN.items():
            for t in ("weight", "bias"):
                out[f"{ours}{a}.{t}"] = Recipe((Part(f"{theirs}{b}.{t}"),))
        for a, b in _GPT2_LINEAR.items():
            out[f"{ours}{a}.weight"] = Recipe((Part(f"{theirs}{b}.weight", transposed=True),))
            out[f"{ours}{a}.bias"] = Recipe((Part(f"{theirs}{b}.bias"),))
        for j, p in enumerate("qkv"):  # column block j of the fused [in, 3d] c_attn, transposed
            out[f"{ours}attn.{p}_proj.weight"] = Recipe((Part(f"{theirs}attn.c_attn.weight", True, 1, j * d,
                                                              (j + 1) * d),))
            out[f"{ours}attn.{p}_proj.bias"] = Recipe((Part(f"{theirs}attn.c_attn.bias", False, 0, j * d,
                                                            (j + 1) * d),))
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
    if not m.n_classes:  # the decoder: tied to the word embeddings unless the model unties it
        names["lm_head.weight"] = "bert.embeddings.word_embeddings.weight" if m.tie_embeddings \
            else "cls.predictions.decoder.weight"
    return names


def bert_alias(m) -> set[str]:
    """bert's tied decoder weight: read from the word embeddings, never written."""
    return {"lm_head.weight"} if m.flavor == "bert" and not m.n_classes and m.tie_embeddings else set()


def our_index(recipe: Recipe, index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[Part, tuple]]:
    """The ``transformers`` reads that give ``ours[index]`` (one slice per dim of our tensor of ``shape``): for a
    plain recipe one ``(part, their index)``; for a stacked one, one per expert in ``index[0]`` (their index
    then covers the remaining dims). A caller transposes a transposed part's result and stacks stacked ones."""
    if recipe.stacked:
        rows = range(*index[0].indices(shape[0]))
        return [(recipe.parts[j], _their_index(recipe.parts[j], index[1:])) for j in rows]
    return [(recipe.parts[0], _their_index(recipe.parts[0], index))]


def _their_index(part: Part, index: tuple[slice, ...]) -> tuple[slice, ...]:
    theirs = list(reversed(index)) if part.transposed else list(index)
    if part.dim is not None:
        s = theirs[part.dim]
        start = part.start + (s.start or 0)
        stop = part.start + (s.stop if s.stop is not None else part.stop - part.start)
        theirs[part.dim] = slice(start, stop)
    return tuple(theirs)


def our_shape(recipe: Recipe, shape_of) -> tuple[int, ...]:
    """Our tensor's shape from the ``transformers`` shapes (``shape_of(name) -> tuple``)."""
    part = recipe.parts[0]
    shape = list(shape_of(part.name))
    if part.dim is not None:
        shape[part.dim] = part.stop - part.start
    if part.transposed:
        shape.reverse()
    return (len(recipe.parts), *shape) if recipe.stacked else tuple(shape)
