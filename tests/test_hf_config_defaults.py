"""A config.json that leaves a key out is imported as ``transformers`` reads it; one without a key that fixes
the model's size is refused in one line naming the key (shardwise.hf.config_map)."""

from __future__ import annotations

import pytest

from shardwise.hf.config_map import HF_DEFAULTS, HF_REQUIRED, HFError, model_fields

SIZES = {"n_embd": 48, "n_layer": 3, "n_head": 4, "n_positions": 40, "hidden_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 40, "vocab_size": 99,
         "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
"""A value for every required key of every family (small and unlike any family's default)."""


def minimal(kind: str) -> dict:
    """A config.json of ``kind`` with only the keys that fix the model's size."""
    return {"model_type": kind, **{k: SIZES[k] for k in HF_REQUIRED[kind]}}


def test_every_family_has_its_rows():
    assert set(HF_DEFAULTS) == set(HF_REQUIRED)


@pytest.mark.parametrize("kind", sorted(HF_REQUIRED))
def test_a_missing_optional_key_means_what_transformers_assumes(kind):
    """Ours from the minimal config.json equals ours from the config transformers builds from it (every optional
    key filled in with its class's default: Qwen3-MoE's norm_topk_prob false, Mixtral's 8 key/value heads,
    rope base 1e6 and eps 1e-5, ...)."""
    from transformers import AutoConfig

    given = minimal(kind)
    filled = AutoConfig.for_model(kind, **{k: v for k, v in given.items() if k != "model_type"}).to_dict()
    assert model_fields(given) == model_fields(filled)


def test_qwen3_moe_without_norm_topk_prob_does_not_renormalise():
    assert model_fields(minimal("qwen3_moe"))["moe_router"] == "softmax"
    assert model_fields({**minimal("qwen3_moe"), "norm_topk_prob": True})["moe_router"] == "softmax_renorm"


@pytest.mark.parametrize(("kind", "key"), [(k, key) for k in sorted(HF_REQUIRED) for key in HF_REQUIRED[k]])
def test_a_missing_size_key_is_named_in_one_line(kind, key):
    given = {k: v for k, v in minimal(kind).items() if k != key}
    with pytest.raises(HFError) as e:
        model_fields(given, "m/config.json")
    assert str(e.value).startswith(f"m/config.json: {key} is missing; a ")
    assert "\n" not in str(e.value)
