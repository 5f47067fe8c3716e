"""The tensors of the llama flavour's ``transformers`` decoder families (:mod:`shardwise.hf.decoders`): which
of theirs make each of ours (:class:`~shardwise.hf.parts.Recipe`), read by import and run backwards by export.

Every family keeps Llama's names (``model.embed_tokens``, ``model.layers.<i>.self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``) and adds or renames:

* Qwen2: biases of q, k and v; Qwen3 / Gemma 3: ``self_attn.{q,k}_norm`` per head; OLMo 2: the same names
  over the whole projections;
* the norms: Llama's ``input_layernorm`` / ``post_attention_layernorm`` are our ``norm1`` / ``norm2``; Gemma's
  four are ``input_layernorm`` (norm1), ``post_attention_layernorm`` (post_norm1), ``pre_feedforward_layernorm``
  (norm2), ``post_feedforward_layernorm`` (post_norm2); OLMo 2's two come after the sub-layers,
  ``post_attention_layernorm`` (norm1) and ``post_feedforward_layernorm`` (norm2);
* Phi-3: ``self_attn.qkv_proj`` holds q, k and v as row blocks, ``mlp.gate_up_proj`` the gate rows then the up
  rows: each of ours is a block of rows of one of them;
* Mixtral: ``block_sparse_moe.gate`` and per expert ``w1`` (gate), ``w3`` (up), ``w2`` (down) -- the Hub layout
  ``save_pretrained`` writes; the fused layout ``transformers`` 5 can also write
  (``mlp.experts.gate_up_proj [E, 2 ff, d]``, ``down_proj``) is read too; Qwen3-MoE and DeepSeek-V3:
  ``mlp.gate`` and ``mlp.experts.<j>.{gate,up,down}_proj`` (or the fused layout), dense ``mlp.*`` in the blocks
  without experts; DeepSeek-V3 also ``mlp.gate.e_score_correction_bias`` (our router's balancing bias) and
  ``mlp.shared_experts.*``;
* DeepSeek-V3's latent attention: ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj``),
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj``.
"""

from __future__ import annotations

from collections.abc import Collection

from shardwise.hf.decoder_config import family_of
from shardwise.hf.parts import Part, Recipe

_NORMS = {
    "pre": {"norm1": "input_layernorm", "norm2": "post_attention_layernorm"},
    "sandwich": {"norm1": "input_layernorm", "post_norm1": "post_attention_layernorm",
                 "norm2": "pre_feedforward_layernorm", "post_norm2": "post_feedforward_layernorm"},
    "post": {"norm1": "post_attention_layernorm", "norm2": "post_feedforward_layernorm"},
}
_LATENT = {"q_a_proj": "q_a_proj", "q_norm": "q_a_layernorm", "q_b_proj": "q_b_proj", "q_proj": "q_proj",
           "kv_a_proj": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
           "o_proj": "o_proj"}
_EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
_GATED = ("gate_proj", "up_proj", "down_proj")


def _plain(theirs: str) -> Recipe:
    return Recipe((Part(theirs),))


def _rows(theirs: str, start: int, stop: int) -> Recipe:
    return Recipe((Part(theirs, dim=0, start=start, stop=stop),))


def decoder_recipes(m, names: Collection[str] | None = None) -> dict[str, Recipe]:
    """Our state-dict key -> its recipe for llama-flavour fields ``m`` (see the module docstring); ``names``: a
    directory's (normalised) tensor names, to pick the per-expert or the fused expert layout."""
    from shardwise.model.moe import is_moe_layer

    kind = family_of(m)
    out = {"tok_emb.weight": _plain("model.embed_tokens.weight"), "norm_f.weight": _plain("model.norm.weight")}
    out["lm_head.weight"] = Recipe((Part("model.embed_tokens.weight"),), alias=True) if m.tie_embeddings \
        else _plain("lm_head.weight")
    for i in range(m.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in _NORMS[m.norm_placement].items():
            out[f"{ours}{a}.weight"] = _plain(f"{theirs}{b}.weight")
        out.update(_latent(m, ours, theirs) if m.kv_lora_rank else _attention(m, ours, theirs, kind))
        if not is_moe_layer(i, m.n_experts or 0, m.moe_every, m.moe_dense_first):
            if kind == "phi3":
                ff = m.d_ff
                out[f"{ours}mlp.gate_proj.weight"] = _rows(f"{theirs}mlp.gate_up_proj.weight", 0, ff)
                out[f"{ours}mlp.up_proj.weight"] = _rows(f"{theirs}mlp.gate_up_proj.weight", ff, 2 * ff)
                out[f"{ours}mlp.down_proj.weight"] = _plain(f"{theirs}mlp.down_proj.weight")
            else:
                out.update({f"{ours}mlp.{p}.weight": _plain(f"{theirs}mlp.{p}.weight") for p in _GATED})
            continue
        moe = theirs + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
        fused = {f"{theirs}mlp.experts.gate_up_proj", f"{moe}experts.gate_up_proj"} & set(names or ())
        if fused:
            moe = f"{theirs}mlp."  # transformers 5's fused layout renames Mixtral's block_sparse_moe too
        out[f"{ours}mlp.router.weight"] = _plain(f"{moe}gate.weight")
        if m.moe_router == "sigmoid_bias":
            out[f"{ours}mlp.router.expert_bias"] = _plain(f"{moe}gate.e_score_correction_bias")
        if m.moe_shared:
            out.update({f"{ours}mlp.shared.{p}.weight": _plain(f"{moe}shared_experts.{p}.weight") for p in _GATED})
        out.update(_experts(m, ours, moe, kind, bool(fused)))
    return out


def _attention(m, ours: str, theirs: str, kind: str) -> dict[str, Recipe]:
    out = {}
    hd = m.head_dim or m.d_model // m.n_heads
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    if kind == "phi3":  # q, k, v: row blocks of the fused qkv_proj
        fused = f"{theirs}self_attn.qkv_proj.weight"
        for p, (start, stop) in zip("qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True):
            out[f"{ours}attn.{p}_proj.weight"] = _rows(fused, start, stop)
    else:
        for p in "qkv":
            out[f"{ours}attn.{p}_proj.weight"] = _plain(f"{theirs}self_attn.{p}_proj.weight")
    out[f"{ours}attn.o_proj.weight"] = _plain(f"{theirs}self_attn.o_proj.weight")
    if m.qkv_bias:
        for p in "qkv":
            out[f"{ours}attn.{p}_proj.bias"] = _plain(f"{theirs}self_attn.{p}_proj.bias")
    if m.qk_norm:
        for p in "qk":
            out[f"{ours}attn.{p}_norm.weight"] = _plain(f"{theirs}self_attn.{p}_norm.weight")
    return out


def _latent(m, ours: str, theirs: str) -> dict[str, Recipe]:
    """DeepSeek's latent attention: renames (its q path has the low-rank pair or one projection)."""
    used = ("q_a_proj", "q_norm", "q_b_proj") if m.q_lora_rank else ("q_proj",)
    used += ("kv_a_proj", "kv_norm", "kv_b_proj", "o_proj")
    return {f"{ours}attn.{a}.weight": _plain(f"{theirs}self_attn.{_LATENT[a]}.weight") for a in used}


def _experts(m, ours: str, moe: str, kind: str, fused: bool) -> dict[str, Recipe]:
    """Our stacked ``experts.{gate,up,down}_proj.weight`` from one tensor per expert, or from the fused
    ``gate_up_proj [E, 2 ff, d]`` (gate rows first) and ``down_proj [E, d, ff]``."""
    out = {}
    ff = m.moe_d_ff or m.d_ff
    for p in _GATED:
        name = _EXPERT_NAMES.get(kind, {}).get(p, p)
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
