"""Mixture-of-experts models in and out of transformers (MixtralForCausalLM, Qwen3MoeForCausalLM), Hub-style
sharded directories both ways, and the bad input of an export or an MoE import, each in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.data.tokenizer import ByteTokenizer
from shardwise.hf.config_map import HFError
from shardwise.hf.export import export_model
from shardwise.hf.load import load_hf_state
from shardwise.model import Transformer
from tests.test_train import assert_same_training, run

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'shardwise[hf]'); the Hugging Face interop tests need it")


def moe_directory(kind: str, path: Path, layout: str = "hub", max_shard_size: str | None = None) -> Path:
    """A directory transformers writes itself (random weights): Mixtral (4 experts, top 2, every block) or
    Qwen3-MoE (QK-norm, experts of their own width on every other block, the un-normalised softmax router).
    ``layout`` "fused": transformers 5's own expert tensors (``gate_up_proj``) instead of the Hub's per expert."""
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, intermediate_size=48,
                                                                           num_local_experts=4))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=24, head_dim=8, num_experts=4,
            decoder_sparse_step=2, norm_topk_prob=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    kwargs = {"save_original_format": layout != "fused"}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def imported(path: Path, **extra):
    cfg = Config.load(overrides={"model.init_from": f"hf:{path}", "parallel.nproc": "1", **extra})
    return resolve(cfg, tokenizer_vocab=257).model


TOKENS = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))


def ours_and_theirs(path: Path):
    m = imported(path)
    ours = Transformer(m)
    ours.load_state_dict(load_hf_state(path, m))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return m, ours.eval(), theirs


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_directory_is_the_same_model_and_round_trips_bit_exactly(kind, tmp_path):
    """Logits equal transformers' within 1e-5 (fp32); import then export gives the same tensors, bit for bit,
    under the same names; transformers' fused expert layout reads as the same model."""
    src = moe_directory(kind, tmp_path / "src")
    m, ours, theirs = ours_and_theirs(src)
    assert (m.n_experts, m.moe_top_k, m.qk_norm) == (4, 2, kind == "qwen3_moe")
    assert (m.moe_router, m.moe_every, m.moe_d_ff) == (("softmax_renorm", 1, None) if kind == "mixtral"
                                                       else ("softmax", 2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), theirs(TOKENS).logits, atol=1e-5, rtol=0)
    out = export_model(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(theirs).__name__]
    with safe_open(str(src / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():  # noqa: SIM118 - safe_open has no __iter__
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    fused = moe_directory(kind, tmp_path / "fused", layout="fused")
    assert any("gate_up_proj" in k for k in safe_open(str(fused / "model.safetensors"), "pt").keys())
    again = load_hf_state(fused, imported(fused))
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def test_sharded_directories_both_ways(tmp_path):
    """A directory transformers wrote in shards (with its index) imports as the single-file one does; our export
    with --max-shard-size writes Hub-style shards and an index that transformers loads, logits unchanged; in
    bf16 the files hold bf16 and config.json says so."""
    whole = moe_directory("mixtral", tmp_path / "whole")
    sharded = moe_directory("mixtral", tmp_path / "sharded", max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    m, ours, theirs = ours_and_theirs(whole)
    state = load_hf_state(sharded, imported(sharded))
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())

    out = export_model(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out", max_shard_size="60KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((out / f).stat().st_size <= 60_000 + 4096 for f in files)  # a shard's tensors <= 60 KB + header
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in ours.state_dict().values())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, theirs(TOKENS).logits, atol=1e-5, rtol=0)

    half = export_model(ours.state_dict(), m, ByteTokenizer(), tmp_path / "bf16", dtype="bf16", max_shard_size="1MB")
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(half / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118


def test_bad_export_and_moe_import_input_is_one_line(tmp_path):
    src = moe_directory("mixtral", tmp_path / "src")
    m, ours, _ = ours_and_theirs(src)
    state = ours.state_dict()
    with pytest.raises(HFError, match=r"^--dtype='fp8' is not a dtype we export; use one of bf16, fp16, fp32$"):
        export_model(state, m, ByteTokenizer(), tmp_path / "a", dtype="fp8")
    with pytest.raises(HFError, match=r"^--max-shard-size=1000 bytes is below the largest tensor, "
                                      r"model.embed_tokens.weight \(38400 bytes\); use at least 38400 bytes"):
        export_model(state, m, ByteTokenizer(), tmp_path / "b", max_shard_size="1KB")
    with pytest.raises(HFError, match=r"^--max-shard-size='lots' is not a size; use e.g. 5GB"):
        export_model(state, m, ByteTokenizer(), tmp_path / "c", max_shard_size="lots")
    with pytest.raises(ConfigError, match=r"^model.n_experts=8 but model.init_from='hf:.*' has 4; remove "
                                          r"model.n_experts$"):
        imported(src, **{"model.n_experts": "8"})
    with pytest.raises(ConfigError, match=r"^model.moe_router='sigmoid_bias' but model.init_from=.* has "
                                          r"'softmax_renorm'; remove model.moe_router$"):
        imported(src, **{"model.moe_router": "sigmoid_bias"})
    import dataclasses

    for change, message in [({"moe_router": "sigmoid_bias"}, r"^model.moe_router='sigmoid_bias': transformers' "
                                                              r"MixtralForCausalLM .* cannot express it"),
                            ({"moe_shared": 1}, r"^model.moe_shared=1: transformers' MixtralForCausalLM")]:
        with pytest.raises(HFError, match=message):
            export_model(state, dataclasses.replace(m, **change), ByteTokenizer(), tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "nothing half-written"


FIRST_LOSS = {"model.preset": "custom", "data.seq_len": 16, "train.steps": 2, "model.moe_aux_coeff": 0.0,
              "model.moe_z_coeff": 0.0}
"""transformers' causal-LM loss has no auxiliary losses (output_router_logits is off): ours are set to 0."""


@pytest.mark.parametrize("kind,name,nproc,overrides", [
    ("mixtral", "ep2", 2, {"parallel.ep": 2}),
    ("qwen3_moe", "tp2", 2, {"parallel.tp": 2}),  # QK-norm and the dense blocks split over tp, MoE blocks whole
    # each rank reads its experts' rows of its hidden units' columns from the directory
    ("mixtral", "ep2-tp2-etp2", 4, {"parallel.ep": 2, "parallel.tp": 2, "parallel.etp": 2}),
])
def test_run_from_a_transformers_moe_directory_starts_at_its_loss(kind, name, nproc, overrides, tmp_path, cache_dir):
    from tests.test_hf_train import first_batch_loss
    from tests.test_train import make_config

    src = moe_directory(kind, tmp_path / "src")
    given = {**FIRST_LOSS, "model.init_from": f"hf:{src}", **overrides}
    losses, _state, _ = run(tmp_path, cache_dir, name, nproc, **given)
    cfg = make_config(tmp_path / "ref", cache_dir, nproc, **given)
    expected = first_batch_loss(cfg, transformers.AutoModelForCausalLM.from_pretrained(src))
    assert losses[0] == pytest.approx(expected, abs=1e-5)


def test_qwen3_shape_trains_the_same_under_tp2(tmp_path, cache_dir):
    """The QK-norm gains see only a tp rank's heads: their gradients are summed over tp, so tp 2 trains the one
    process's model (losses, pre-clip gradient norms, weights)."""
    src = moe_directory("qwen3_moe", tmp_path / "src")
    given = {**FIRST_LOSS, "model.init_from": f"hf:{src}", "train.steps": 3}
    ref = run(tmp_path, cache_dir, "one", 1, **given, **{"train.micro_batch": 4})
    assert_same_training(run(tmp_path, cache_dir, "tp2", 2, **given, **{"parallel.tp": 2}), ref, atol=1e-5)


@pytest.mark.parametrize("flavor", ["gpt2", "bert"])
def test_an_export_of_gelu_experts_is_refused(flavor):
    """GPT2LMHeadModel and BertForMaskedLM have dense MLPs only: a MoE model of those flavours has no transformers
    class, and writing one would let transformers fill its MLPs with random weights (a silently different model)."""
    from shardwise.hf.config_map import hf_config

    m = resolve(Config.load(overrides={"model.preset": "tiny-moe", "model.flavor": flavor,
                                       "parallel.nproc": "1"} | ({"train.objective": "mlm"} if flavor == "bert"
                                                                 else {})), tokenizer_vocab=257).model
    with pytest.raises(HFError, match=rf"^model.flavor='{flavor}' with model.n_experts=\d+: transformers' .* has no "
                                      r"experts \(its MLPs would load as random weights\)"):
        hf_config(m)
