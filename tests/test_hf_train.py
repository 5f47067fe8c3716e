"""``model.init_from = "hf:PATH"`` starts a run from a transformers directory on any layout: the first loss
is the transformers model's loss on the same batch (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardwise.data import DistributedWindowSampler, TokenWindows, prepare_corpus
from tests.test_hf import _transformers_directory
from tests.test_train import run

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'shardwise[hf]'); the Hugging Face interop tests need it")


def first_batch_loss(cfg, model) -> float:
    """The transformers model's mean next-token loss on the run's first global batch."""
    corpus = prepare_corpus(cfg.data, None)
    windows = TokenWindows(corpus.train_path, cfg.data.seq_len)
    sampler = DistributedWindowSampler(len(windows), cfg.train.global_batch, cfg.train.seed)
    x, y = windows.batch(sampler.micro_batches(0, cfg.train.global_batch)[0])
    with torch.no_grad():
        logits = model.eval()(x).logits
    return float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))


LAYOUTS = {
    "gpt2-dp2": ("gpt2", {}),
    "gpt2-zero3": ("gpt2", {"parallel.zero": 3}),
    "gpt2-pp2": ("gpt2", {"parallel.pp": 2}),
    "llama-dp2": ("llama", {}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_run_from_transformers_directory_starts_at_its_loss(layout, tmp_path, cache_dir):
    from tests.test_train import make_config

    flavor, overrides = LAYOUTS[layout]
    src = _transformers_directory(flavor, tmp_path / "src")
    overrides = {"model.preset": "custom", "model.init_from": f"hf:{src}", "data.seq_len": 16, "train.steps": 2,
                 **overrides}
    losses, _state, _ = run(tmp_path, cache_dir, layout, 2, **overrides)
    cfg = make_config(tmp_path / "ref", cache_dir, 2, **overrides)
    expected = first_batch_loss(cfg, transformers.AutoModelForCausalLM.from_pretrained(src))
    assert losses[0] == pytest.approx(expected, abs=1e-5)


def test_export_command_writes_the_trained_run(tmp_path, cache_dir, capsys):
    """`shardwise export RUN_DIR --format hf OUT_DIR` after a real run: transformers gives our logits; a second
    export into the now non-empty directory fails with one line."""
    from shardwise.cli import main
    from shardwise.generate_run import load_trained_model

    run(tmp_path, cache_dir, "trained", 1, **{"train.steps": 2})
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "trained"), "--format", "hf", str(out)]) == 0
    ours, _ = load_trained_model(tmp_path / "trained")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits, atol=1e-5, rtol=0)
    assert main(["export", str(tmp_path / "trained"), "--format", "hf", str(out)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err

    # and `shardwise generate` with a batch of prompts: the same text with and without the key/value cache
    argv = ["generate", str(tmp_path / "trained"), "--prompt", "import ", "--prompt", "x", "--max-new-tokens", "6"]
    texts = []
    for extra in ([], ["--no-cache"]):
        assert main(argv + extra) == 0
        captured = capsys.readouterr()
        texts.append(captured.out)
        assert "12 tokens in" in captured.err and "tokens/s" in captured.err
    assert texts[0] == texts[1] and texts[0].startswith("import ")


def test_export_of_a_bf16_run_is_bf16_and_sharded_when_asked(tmp_path, cache_dir, capsys):
    """The export's dtype defaults to the run's parameter dtype (bf16 here); --max-shard-size gives Hub-style shards
    and an index that transformers loads; an unknown --dtype fails in one line."""
    from safetensors import safe_open

    from shardwise.cli import main
    from shardwise.generate_run import load_trained_model

    run(tmp_path, cache_dir, "bf16", 1, **{"train.steps": 1, "train.precision": "bf16"})
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "bf16"), "--format", "hf", str(out), "--max-shard-size", "40KB"]) == 0
    assert "weight shards and their index" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    ours, _ = load_trained_model(tmp_path / "bf16")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_bf16 = ours.to(torch.bfloat16).float()  # the same rounding of every weight
        torch.testing.assert_close(ours_bf16.eval()(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)
    capsys.readouterr()  # transformers' loading bars
    assert main(["export", str(tmp_path / "bf16"), "--format", "hf", str(tmp_path / "x"), "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --dtype='fp8' is not a dtype we export; use one of bf16, "
                                               "fp16, fp32")
