"""Hugging Face interop (shardwise.hf): an exported directory is the same model in transformers, import
then export is bit-exact, bad directories are named, exports are atomic, and a run started from an
imported directory has the transformers model's first loss on every layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.data.tokenizer import ByteTokenizer
from shardwise.hf.config_map import HFError
from shardwise.hf.export import export_model
from shardwise.hf.load import load_hf_state
from shardwise.model import Transformer

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'shardwise[hf]'); the Hugging Face interop tests need it")

SHAPES = {
    "gpt2": {"model.flavor": "gpt2", "model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4,
             "model.max_seq_len": 16, "model.vocab_size": 300},
    "llama": {"model.flavor": "llama", "model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4,
              "model.n_kv_heads": 2, "model.d_ff": 96, "model.max_seq_len": 16, "model.vocab_size": 300,
              "model.rope_theta": 5e5},
    "bert": {"model.flavor": "bert", "model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4,
             "model.max_seq_len": 16, "model.vocab_size": 300, "train.objective": "mlm"},
}
CLASSIFY = {"train.objective": "classify", "data.source": __file__, "data.format": "jsonl"}
"""A classifier's config needs a labelled source; this one is never read."""
SHAPES["bert_cls"] = {**SHAPES["bert"], **CLASSIFY, "model.n_classes": 3}


def model_config(overrides: dict):
    cfg = Config.load(overrides={"model.preset": "custom", "parallel.nproc": "1", **{k: str(v) for k, v in
                                                                                      overrides.items()}})
    return resolve(cfg, tokenizer_vocab=257).model


def random_model(flavor: str, seed: int = 0) -> Transformer:
    """A model whose every parameter (biases and norm gains too) is random, so no mapping error hides."""
    model = Transformer(model_config(SHAPES[flavor]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


ARCH = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}


@pytest.mark.parametrize("flavor", ["gpt2", "llama", "bert"])
def test_exported_directory_is_the_same_model_in_transformers(flavor, tmp_path):
    model = random_model(flavor)
    out = export_model(model.state_dict(), model.cfg, ByteTokenizer(), tmp_path / "out")
    auto = transformers.AutoModelForMaskedLM if flavor == "bert" else transformers.AutoModelForCausalLM
    theirs = auto.from_pretrained(out).eval()
    assert type(theirs).__name__ == ARCH[flavor]
    tokens = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(tokens), theirs(tokens).logits
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
        if flavor == "bert":  # padding masks and token types
            mask = torch.ones(3, 16, dtype=torch.bool)
            mask[1, 10:] = mask[2, 4:] = False
            types = (torch.arange(16) >= 8).long().expand(3, 16)
            ours = model(tokens, padding_mask=mask, token_types=types)
            ref = theirs(tokens, attention_mask=mask.long(), token_type_ids=types).logits
            torch.testing.assert_close(ours[mask], ref[mask], atol=1e-5, rtol=0)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo wörld ✓\n\tdef f(x):"
    assert tok.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    assert tok.eos_token_id == 256 and tok.decode(ByteTokenizer().encode(text)) == text


def test_bert_classifier_exports_as_sequence_classification(tmp_path):
    from shardwise.model.transformer import bert_special_ids

    model = random_model("bert_cls")
    out = export_model(model.state_dict(), model.cfg, ByteTokenizer(), tmp_path / "out")
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(theirs).__name__ == "BertForSequenceClassification" and theirs.config.num_labels == 3
    pad, cls, _ = bert_special_ids(300)
    tokens = torch.randint(0, 257, (3, 16), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = cls
    tokens[1, 9:] = tokens[2, 5:] = pad
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens, attention_mask=(tokens != pad).long()).logits,
                                   atol=1e-5, rtol=0)
    back = load_hf_state(out, _imported_config(out, **CLASSIFY))
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def _transformers_directory(flavor: str, path: Path) -> Path:
    """A directory written by transformers itself (random weights, save_pretrained)."""
    torch.manual_seed(0)
    if flavor == "gpt2":
        config = transformers.GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(config)
    elif flavor == "bert":
        config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=16)
        model = transformers.BertForMaskedLM(config)
    else:
        config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                          tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def _imported_config(path: Path, **extra):
    cfg = Config.load(overrides={"model.init_from": f"hf:{path}", "parallel.nproc": "1", **extra})
    return resolve(cfg, tokenizer_vocab=257).model


@pytest.mark.parametrize("flavor", ["gpt2", "llama", "bert"])
def test_import_then_export_is_bit_exact(flavor, tmp_path):
    src = _transformers_directory(flavor, tmp_path / "src")
    m = _imported_config(src, **({"train.objective": "mlm"} if flavor == "bert" else {}))
    assert m.flavor == flavor and (m.n_kv_heads, m.tie_embeddings) == ((2, False) if flavor == "llama" else (4, True))
    state = load_hf_state(src, m)
    ours = Transformer(m)
    ours.load_state_dict(state)
    out = export_model(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out")
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    before = {k: v for k, v in before.items()
              if not k.endswith((".attn.bias", ".attn.masked_bias", "position_ids", "decoder.bias"))}
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    if flavor == "gpt2":  # the Hub's GPT-2 checkpoints are GPT2Model's: no "transformer." prefix
        save_file({k.removeprefix("transformer."): v for k, v in before.items()}, str(src / "model.safetensors"),
                  metadata={"format": "pt"})
        assert all(torch.equal(load_hf_state(src, m)[k], v) for k, v in state.items())


def test_unsupported_or_mismatched_directories_are_named(tmp_path):
    src = _transformers_directory("gpt2", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())

    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({**config, "model_type": "t5", "architectures": ["T5Model"]}))
    with pytest.raises(ConfigError, match=r"^model.init_from='hf:.*model_type='t5' .* is not supported; use one of "):
        _imported_config(bert)
    with pytest.raises(ConfigError, match=r"^model.init_from='gpt2': not a source we read; use 'hf:PATH'"):
        resolve(Config.load(overrides={"model.init_from": "gpt2"}), tokenizer_vocab=257)
    with pytest.raises(ConfigError, match=r"^model.n_layers=3 but model.init_from=.* has 2; remove model.n_layers"):
        resolve(Config.load(overrides={"model.init_from": f"hf:{src}", "model.n_layers": "3"}), tokenizer_vocab=257)

    m = _imported_config(src)
    tensors = load_file(src / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(32, 100)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFError, match=r"tensor transformer.h.1.mlp.c_fc.weight has shape \[32, 100\], but "
                                      r"config.json implies \[32, 128\]"):
        load_hf_state(src, m)
    with pytest.raises(ConfigError, match=r"^model.init_from='hf:.*': .*tensor transformer.h.1.mlp.c_fc.weight has "
                                          r"shape \[32, 100\]"):  # before any worker starts
        _imported_config(src)
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFError, match=r"tensor transformer.h.1.mlp.c_fc.weight is missing"):
        load_hf_state(src, m)


def test_export_is_atomic(tmp_path, monkeypatch):
    model = random_model("gpt2")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_model(model.state_dict(), model.cfg, ByteTokenizer(), taken)

    import shardwise.hf.export as export

    def fail(*_a):
        raise OSError("disk full")

    monkeypatch.setattr(export, "write_tokenizer", fail)
    with pytest.raises(OSError, match="disk full"):
        export_model(model.state_dict(), model.cfg, ByteTokenizer(), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"], "nothing half-written"


@pytest.mark.parametrize("name", ["/etc/hostname", "../model.safetensors", "sub/model.safetensors", ".."])
def test_an_index_names_only_files_inside_its_directory(tmp_path, name):
    """``model.safetensors.index.json``'s weight_map may name only plain files of its directory: a path that
    leads out of it (absolute, ``../``, a subdirectory) is refused, naming it, before anything is opened."""
    from shardwise.hf.load import INDEX_FILE, weight_files

    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"a.weight": "model-1.safetensors",
                                                                   "b.weight": name}}))
    with pytest.raises(HFError, match=f"weight_map names {name!r}, not a file name inside"):
        weight_files(directory)
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"a.weight": "model-1.safetensors"}}))
    assert weight_files(directory) == [directory / "model-1.safetensors"]
