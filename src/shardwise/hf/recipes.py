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
* BERT (``BertForMaskedLM`` / ``...ForSequenceClassification``): renames;
* the llama flavour's decoder families (Llama, Qwen, Mistral, Mixtral, Gemma, OLMo 2, Phi-3, DeepSeek-V3):
  :mod:`shardwise.hf.decoder_recipes`.
"""

from __future__ import annotations

from collections.abc import Collection

from shardwise.hf.decoder_recipes import decoder_recipes
from shardwise.hf.parts import Part, Recipe, our_index, our_shape

__all__ = ["Part", "Recipe", "bert_alias", "our_index", "our_shape", "recipes"]


def recipes(m, names: Collection[str] | None = None) -> dict[str, Recipe]:
    """Our state-dict key -> its recipe, for a model with fields ``m``. ``names``: the (normalised) tensor names
    of a directory being read, to pick between the per-expert and the fused expert layouts (None: per expert,
    the layout we write)."""
    if m.flavor == "bert":
        return {ours: Recipe((Part(theirs),)) for ours, theirs in _bert_names(m).items()}
    if m.flavor == "gpt2":
        return _gpt2(m)
    return decoder_recipes(m, names)


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
