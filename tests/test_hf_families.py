"""The decoder families of the released open models (Llama 3.1+, Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3,
OLMo 2, Phi-3, DeepSeek-V3) in and out of transformers: each family's own class builds a small model with every
quirk of the released sizes (:mod:`tests.hf_families`); we import it and compute its logits (fp32, within 1e-5),
export it back bit for bit under the same names, and transformers loads our export as the same function. Keys we
cannot build are refused in one line naming them; a sliding window, soft-capping and latent attention decode
with the key/value cache as without it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.data.tokenizer import ByteTokenizer
from shardwise.hf.config_map import HFError, model_fields
from shardwise.hf.export import export_model
from shardwise.hf.load import load_hf_state
from shardwise.model import Transformer
from shardwise.model.generate import generate_batch
from tests.hf_families import FAMILIES, family_directory

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'shardwise[hf]'); the Hugging Face interop tests need it")

TOKENS = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
"""Longer than every toy model's sliding window (5) and Llama 3.1's toy "original" context (16 positions)."""


def imported(path, **extra):
    cfg = Config.load(overrides={"model.init_from": f"hf:{path}", "parallel.nproc": "1", **extra})
    return resolve(cfg, tokenizer_vocab=257).model


def ours_from(path):
    m = imported(path)
    model = Transformer(m)
    model.load_state_dict(load_hf_state(path, m))
    return m, model.eval()


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_family_is_the_transformers_function_both_ways(kind, tmp_path):
    src = family_directory(kind, tmp_path / "src")
    m, ours = ours_from(src)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    assert m.hf_model_type == kind
    with torch.no_grad():
        expected = theirs(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, atol=1e-5, rtol=0)
    out = export_model(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (kind, [type(theirs).__name__])
    with safe_open(str(src / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():  # noqa: SIM118 - safe_open has no __iter__
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, atol=1e-5, rtol=0)
    assert dataclasses.replace(imported(out), init_from=m.init_from) == m  # the fields survive the round trip


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "deepseek_v3"])
def test_cached_decoding_is_the_whole_forward(kind, tmp_path):
    """Greedy decoding of a left-padded batch with the key/value cache (a sliding window over cached keys, soft-capped
    scores, latent attention's cached latents) gives each prompt's tokens of decoding it alone without a cache, and
    transformers' own greedy tokens."""
    src = family_directory(kind, tmp_path / "src")
    _, ours = ours_from(src)
    prompts = [TOKENS[0, :9].tolist(), TOKENS[1, :4].tolist()]
    cached = generate_batch(ours, prompts, 4, temperature=0)
    for prompt, tokens in zip(prompts, cached, strict=True):
        assert generate_batch(ours, [prompt], 4, temperature=0, use_cache=False)[0] == tokens
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    out = theirs.generate(TOKENS[:1, :9], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out[0, 9:].tolist() == cached[0]


REFUSED = [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_type='dynamic' is not supported; use 'default', 'linear', 'llama3' or 'yarn'"),
    ("llama", {"attention_bias": True}, r"attention_bias=True is not supported; use false"),
    ("llama", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; use 'silu'"),
    ("llama", {"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supported; use 0"),
    ("qwen2", {"use_sliding_window": True}, r"use_sliding_window=True is not supported; use false"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, r"use_sliding_window=.* is not supported"),
    ("gemma2", {"hidden_activation": "gelu"}, r"hidden_activation='gelu' is not supported"),
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types=.* is not supported; every k-th layer global"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0 is not supported; use null"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 2, "long_factor": [1.0] * 2,
                                  "rope_theta": 1e4}}, r"rope_type='longrope' is not supported"),
    ("deepseek_v3", {"rope_interleave": False}, r"rope_interleave=False is not supported; use true"),
    ("deepseek_v3", {"norm_topk_prob": False}, r"norm_topk_prob=False is not supported"),
    ("deepseek_v3", {"topk_method": "greedy"}, r"topk_method='greedy' is not supported; use 'noaux_tc'"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supported"),
]


@pytest.mark.parametrize("kind,change,message", REFUSED, ids=[f"{k}-{next(iter(c))}" for k, c, _ in REFUSED])
def test_keys_we_cannot_build_are_refused_in_one_line(kind, change, message):
    from tests.hf_families import BASE

    config = {"model_type": kind, **BASE, **change}
    with pytest.raises(HFError, match=r"^config.json: " + message) as e:
        model_fields(config)
    assert "\n" not in str(e.value)


def test_defaults_are_transformers_defaults():
    """A config.json that leaves a key out means what it means to transformers: the family's own default."""
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
             "vocab_size": 300}
    for kind, expected in [("qwen3", dict(head_dim=128, n_kv_heads=32, max_seq_len=32768, norm_eps=1e-6)),
                           ("mistral", dict(sliding_window=4096, n_kv_heads=8, max_seq_len=131072)),
                           ("gemma2", dict(head_dim=256, attn_scale_dim=256.0, attn_softcap=50.0,
                                           final_softcap=30.0, sliding_global_every=2, tie_embeddings=True)),
                           ("gemma3_text", dict(rope_theta=1e6, rope_local_theta=1e4, sliding_global_every=6)),
                           ("deepseek_v3", dict(kv_lora_rank=512, q_lora_rank=1536, head_dim=192, rope_dim=64,
                                                moe_dense_first=3, moe_groups=8, moe_gate_scale=2.5))]:
        fields = model_fields({"model_type": kind, **shape})
        assert {k: fields[k] for k in expected} == expected, kind
    with pytest.raises(HFError, match=r"^config.json: hidden_size is missing; a LlamaForCausalLM config.json"):
        model_fields({"model_type": "llama", **{k: v for k, v in shape.items() if k != "hidden_size"}})


def test_an_export_the_family_cannot_say_is_refused(tmp_path):
    """A field the chosen family has no key for is named, and nothing is written."""
    import dataclasses

    src = family_directory("qwen3", tmp_path / "src")
    m, ours = ours_from(src)
    for change, message in [({"sliding_window": 4}, r"^model.sliding_window=4: transformers' Qwen3ForCausalLM"),
                            ({"hf_model_type": "llama"}, r"^model.qk_norm=True: transformers' LlamaForCausalLM")]:
        with pytest.raises(HFError, match=message):
            export_model(ours.state_dict(), dataclasses.replace(m, **change), ByteTokenizer(), tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=r"^model.sliding_window=4 but model.init_from=.* has 0; remove"):
        imported(src, **{"model.sliding_window": "4"})


def test_image_text_gemma3_and_deepseek_extras_are_read_as_their_language_model(tmp_path):
    """Gemma 3's image-text checkpoint (Gemma3ForConditionalGeneration, the released 4B-27B) imports as its language
    model, the vision tower left out; DeepSeek-V3's multi-token-prediction layer (past num_hidden_layers) is left
    out as transformers leaves it; quantized weights (DeepSeek-V3's released fp8) are refused in one line."""
    from safetensors.torch import load_file, save_file

    from tests.hf_families import BASE

    text = {**BASE, **FAMILIES["gemma3_text"][2], "final_logit_softcapping": None}  # the image-text class has none
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    model.save_pretrained(tmp_path / "gemma3")
    m, ours = ours_from(tmp_path / "gemma3")
    assert m.hf_model_type == "gemma3_text"
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), model(input_ids=TOKENS).logits, atol=1e-5, rtol=0)

    src = family_directory("deepseek_v3", tmp_path / "dsv3")
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, "model.layers.3.eh_proj.weight": torch.zeros(32, 64)}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    _, ours = ours_from(src)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), theirs(TOKENS).logits, atol=1e-5, rtol=0)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match=r"^model.init_from=.*quantization_config.quant_method='fp8': quantized "
                                          r"weights are not read"):
        imported(src)


def test_layouts_that_cannot_carry_a_feature_are_refused_in_one_line():
    from tests.test_config_fields import resolve as resolve_fields

    llama = {"model.flavor": "llama", "parallel.cp": 2}
    for extra, message in [
        ({"model.sliding_window": 4}, r"^parallel.cp_algorithm='ring' with model.sliding_window=4: the ring's blocks"),
        ({"model.attn_softcap": 50.0}, r"^parallel.cp_algorithm='ring' with model.attn_softcap=50.0"),
        ({"model.kv_lora_rank": 8, "model.rope_dim": 4, "model.head_dim": 12},
         r"^parallel.cp_algorithm='ring' with model.kv_lora_rank=8: .* use 'allgather' or 'ulysses'"),
        ({"parallel.cp": 1, "parallel.tp": 4, "parallel.nproc": 4, "model.n_heads": 8, "model.n_kv_heads": 2,
          "model.qk_norm": True, "model.qk_norm_scope": "projection"},
         r"^parallel.tp=4 with model.qk_norm_scope='projection' and model.n_kv_heads=2"),
    ]:
        with pytest.raises(ConfigError, match=message) as e:
            resolve_fields({**llama, **extra})
        assert "\n" not in str(e.value)
