"""Our single-process state dict <-> ``transformers`` tensor names and layouts, from one table (:mod:`.recipes`).

Import reads each of our tensors through its recipe (:class:`~shardwise.hf.lazy.LazyHFState`, which reads
only the slices asked for); export runs the same recipes backwards (:func:`hf_layout`): every ``transformers``
tensor is assembled from the pieces of ours that map into it (a GPT-2 ``c_attn`` from q, k and v; a Mixtral
expert from one row of our stacked tensor). The mappings are exact (transposes, concatenations and slices
only): import then export gives the same bits. :func:`check_shapes` names every missing tensor or mismatched
shape before any conversion.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import torch

from shardwise.hf.config_map import HFError
from shardwise.hf.lazy import LazyHFState
from shardwise.hf.recipes import Part, bert_alias, recipes

State = Mapping[str, torch.Tensor]

_DROPPED = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "position_ids")
"""Buffers some ``transformers`` versions saved (GPT-2's causal masks, rotary frequencies): not weights."""
_TIED_HEADS = {"lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
"""Output heads a tied model may or may not save: never unexpected."""


_LANGUAGE_MODEL = {"language_model.model.": "model.", "model.language_model.": "model.",
                   "language_model.lm_head.": "lm_head."}
"""An image-text checkpoint's language model (Gemma 3: the Hub's names, transformers 5's) under a text model's names."""
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
"""An image-text checkpoint's vision side: not part of the language model we train."""


def normalize_name(name: str, m) -> str | None:
    """``name`` as :func:`to_hf` writes it (the Hub's base-model checkpoints, ``GPT2Model``'s ``h.0...`` or
    ``LlamaModel``'s ``layers.0...``, lack the ``transformer.`` / ``model.`` prefix), or None for a buffer, a
    vision tower, or DeepSeek-V3's multi-token-prediction layers (past ``num_hidden_layers``: transformers leaves
    them out as well)."""
    if name.endswith(_DROPPED) or name.startswith(_OTHER_TOWERS):
        return None
    for prefix, ours in _LANGUAGE_MODEL.items():
        if name.startswith(prefix):
            name = ours + name[len(prefix):]
    if m.flavor == "llama" and m.kv_lora_rank and name.startswith("model.layers."):
        if int(name.split(".")[2]) >= m.n_layers:
            return None
    prefix = {"gpt2": "transformer.", "llama": "model.", "bert": "bert."}[m.flavor]
    keep = name.startswith((prefix, "cls.", "classifier.")) or name == "lm_head.weight"
    return name if keep else prefix + name


def normalized(hf: Mapping, m) -> dict:
    """``hf`` with every key normalised (:func:`normalize_name`), buffers dropped."""
    return {n: v for k, v in hf.items() if (n := normalize_name(k, m)) is not None}


@dataclass
class HFTensor:
    """One ``transformers`` tensor of an export: its shape and where each piece of it comes from."""

    shape: tuple[int, ...]
    sources: list[tuple[str, int | None, Part]] = field(default_factory=list)
    """``(our key, expert row or None, part)``: ``ours[key]`` (or its row) fills ``part``'s region."""


def hf_layout(m, our_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, HFTensor]:
    """Every ``transformers`` tensor our model (fields ``m``, tensors of ``our_shapes``) exports to, in our
    state's order; a tied output head is left out, as ``save_pretrained`` does."""
    alias = bert_alias(m)
    out: dict[str, HFTensor] = {}
    for key, recipe in recipes(m).items():
        if recipe.alias or key in alias or key not in our_shapes:
            continue
        for j, part in enumerate(recipe.parts):
            piece = _their_shape(recipe, part, our_shapes[key])
            t = out.setdefault(part.name, HFTensor(piece))
            t.shape = tuple(max(a, b) for a, b in zip(t.shape, piece, strict=True))
            t.sources.append((key, j if recipe.stacked else None, part))
    return out


def _their_shape(recipe, part: Part, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The (least) shape of ``part``'s tensor, given our tensor's ``shape``: a fused tensor spans its parts' rows."""
    piece = list(shape[1:] if recipe.stacked else shape)
    if part.transposed:
        piece.reverse()
    if part.dim is not None:
        piece[part.dim] = part.stop
    return tuple(piece)


def assemble(t: HFTensor, ours: Callable[[str, int | None], torch.Tensor], dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """The ``transformers`` tensor ``t`` from ours: ``ours(key, row)`` gives ``ours[key]`` (or its expert row)."""
    if len(t.sources) == 1 and t.sources[0][2].dim is None:  # a plain rename or transpose: no copy
        key, row, part = t.sources[0]
        value = ours(key, row)
        value = value.t() if part.transposed else value
        return value.to(dtype or value.dtype).contiguous()
    out = None
    for key, row, part in t.sources:
        value = ours(key, row)
        value = value.t() if part.transposed else value
        if out is None:
            out = torch.empty(t.shape, dtype=dtype or value.dtype)
        region = [slice(None)] * len(t.shape)
        region[part.dim] = slice(part.start, part.stop)
        out[tuple(region)] = value
    return out


def to_hf(state: State, m) -> dict[str, torch.Tensor]:
    """The ``transformers`` state of our model state ``state`` (fields ``m``); contiguous tensors. A tied output
    head is left out, as ``save_pretrained`` does."""
    layout = hf_layout(m, {k: tuple(v.shape) for k, v in state.items()})
    return {name: assemble(t, lambda key, row: state[key] if row is None else state[key][row])
            for name, t in layout.items()}


class _InMemory:
    """A dict of ``transformers`` tensors as :class:`~shardwise.hf.lazy.LazyHFState` reads files."""

    def __init__(self, hf: Mapping[str, torch.Tensor]):
        self.tensors = hf
        self.shapes = {k: tuple(v.shape) for k, v in hf.items()}

    def read(self, name: str, index) -> torch.Tensor:
        return self.tensors[name][index]


def from_hf(hf: State, m) -> dict[str, torch.Tensor]:
    """Our model state (every key of ``Transformer(m).state_dict()``) from a ``transformers`` state."""
    hf = normalized(hf, m)
    lazy = LazyHFState(_InMemory(hf), recipes(m, hf.keys()), dtype=None)
    return {k: lazy[k] for k in lazy}


def expected_shapes(m, names: Collection[str] | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of every ``transformers`` tensor of a model with fields ``m`` (from a meta-device model);
    ``names``: a directory's tensor names (its expert layout)."""
    from shardwise.model import Transformer

    with torch.device("meta"):
        state = Transformer(m).state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    needed: dict[str, tuple[int, ...]] = {}
    for key, recipe in recipes(m, names).items():
        for part in recipe.parts:
            shape = _their_shape(recipe, part, shapes[key])
            needed[part.name] = tuple(max(a, b) for a, b in zip(needed.get(part.name, shape), shape, strict=True))
    return needed


def check_shapes(hf_shapes: Mapping[str, tuple[int, ...]], m, where: str) -> None:
    """HFError naming the first tensor that is missing, or whose shape differs from what ``config.json``
    implies (both shapes), or that the mapping does not know."""
    given = normalized(hf_shapes, m)
    expected = expected_shapes(m, given.keys())
    for key, shape in expected.items():
        if key not in given:
            raise HFError(f"{where}: tensor {key} is missing (expected shape {list(shape)})")
        if tuple(given[key]) != shape:
            raise HFError(f"{where}: tensor {key} has shape {list(given[key])}, but config.json implies "
                          f"{list(shape)}")
    unknown = sorted(set(given) - set(expected) - _TIED_HEADS)
    if unknown:
        raise HFError(f"{where}: tensor {unknown[0]} is not part of a {m.flavor} model with this config.json "
                      f"({len(unknown)} unknown tensors)")
