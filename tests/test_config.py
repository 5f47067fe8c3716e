"""The config tree: parsing, overrides, batch arithmetic and validation errors before any worker starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardwise import config_resolve
from shardwise.cli import main, split_overrides
from shardwise.config import Config, ConfigError


def resolve(**overrides) -> Config:
    overrides = {k.replace("__", "."): str(v) for k, v in overrides.items()}
    return config_resolve.resolve(Config.load(overrides=overrides), tokenizer_vocab=257)


def test_defaults_resolve_to_the_cpu_demo():
    cfg = resolve()
    assert cfg.model.preset == "cpu-demo" and cfg.model.vocab_size == 257
    assert cfg.parallel.nproc == 2 and cfg.parallel.dp == 2
    assert cfg.train.global_batch == cfg.train.micro_batch * cfg.train.grad_accum * cfg.parallel.dp


def test_overrides_and_toml_round_trip(tmp_path):
    cfg = resolve(train__lr="3e-4", model__preset="tiny-llama", train__precision="bf16", run__progress="false")
    assert cfg.train.lr == 3e-4 and cfg.model.flavor == "llama" and cfg.run.progress is False
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    again = config_resolve.resolve(Config.load(path), tokenizer_vocab=257)
    assert again == cfg


def test_explicit_fields_override_the_preset():
    cfg = resolve(model__preset="tiny", model__n_layers=5)
    assert cfg.model.n_layers == 5 and cfg.model.d_model == 64


@pytest.mark.parametrize(
    "given, expected",
    [
        (dict(global_batch=16), (16, 8, 1)),  # dp=2: micro = 16 / 2
        (dict(global_batch=16, micro_batch=2), (16, 2, 4)),
        (dict(global_batch=16, grad_accum=2), (16, 4, 2)),
        (dict(global_batch="none", micro_batch=3, grad_accum=2), (12, 3, 2)),
        (dict(global_batch=12, micro_batch=3, grad_accum=2), (12, 3, 2)),
    ],
)
def test_any_two_batch_fields_set_the_third(given, expected):
    cfg = resolve(**{f"train__{k}": v for k, v in given.items()})
    assert (cfg.train.global_batch, cfg.train.micro_batch, cfg.train.grad_accum) == expected


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"parallel.nproc": "2", "parallel.dp": "4"}, "does not match the world size 2"),
        ({"train.global_batch": "16", "train.micro_batch": "3"}, "not divisible by train.micro_batch"),
        ({"train.global_batch": "16", "train.micro_batch": "2", "train.grad_accum": "3"}, "set only two"),
        ({"train.lr": "-1"}, "train.lr=-1.0 must be a positive number"),
        ({"data.source": "/no/such/corpus"}, "data.source='/no/such/corpus' does not exist"),
        ({"model.preset": "gpt5"}, "model.preset='gpt5' is not valid"),
        ({"model.n_heads": "3"}, "model.n_heads=3 does not divide model.d_model=256; use one of 1, 2, 4, 8"),
        ({"parallel.tp": "3", "parallel.nproc": "3"}, "parallel.tp=3 does not divide model.n_heads=8; use 1, 2, 4, 8"),
        ({"parallel.sequence_parallel": "true", "parallel.tp": "2", "parallel.nproc": "2", "data.seq_len": "127",
          "model.max_seq_len": "128"}, "needs data.seq_len=127 divisible by parallel.tp=2"),
        ({"train.precision": "fp8"}, "train.precision='fp8' is not valid; use one of 'fp32', 'bf16', 'fp16'"),
        ({"train.steps": "ten"}, "train.steps='ten' is not an integer"),
    ],
)
def test_invalid_values_name_the_field_and_what_is_valid(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        config_resolve.resolve(Config.load(overrides=overrides), tokenizer_vocab=257)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match="did you mean 'train.lr'"):
        Config.load(overrides={"train.lrr": "1"})


def test_vocab_smaller_than_tokenizer_is_rejected():
    with pytest.raises(ConfigError, match="smaller than the tokenizer's vocabulary"):
        config_resolve.resolve(Config.load(overrides={"model.vocab_size": "100"}), tokenizer_vocab=257)


def test_split_overrides():
    rest, ov = split_overrides(["train", "a.toml", "--train.lr", "1e-3", "--run.dir=x", "--ckpt.resume", "--debug"])
    assert rest == ["train", "a.toml", "--debug"]
    assert ov == {"train.lr": "1e-3", "run.dir": "x", "ckpt.resume": "true"}


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--parallel.nproc", "2", "--parallel.dp", "4"],
        ["train", "--train.global_batch", "10", "--train.micro_batch", "3"],
        ["train", "--no.such_key", "1"],
        ["train", "--train.lr", "-0.1"],
        ["train", "--data.source", "/missing/data"],
        ["train", "/missing/config.toml"],
    ],
)
def test_cli_rejects_bad_config_before_spawning(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists(), "nothing may be created for an invalid config"


def test_cli_exit_code_and_single_line_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "train", "--train.lr", "-1"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: train.lr=-1.0 must be a positive number"]


def test_config_show_prints_resolved_toml(capsys):
    assert main(["config", "show", "--model.preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert 'preset = "tiny"' in out and "d_model = 64" in out


SHIPPED_CONFIGS = [  # training configs (configs/ also holds other TOML, e.g. a hardware catalogue)
    p for p in sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    if "[model]" in p.read_text() or "[train]" in p.read_text()
]


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    config_resolve.resolve(Config.load(path), tokenizer_vocab=4096 if "bpe" in path.read_text() else 257)


def test_device_picks_the_backend():
    assert resolve(run__device="cpu").parallel.backend == "gloo"
    with pytest.raises(ConfigError, match="needs GPUs"):
        resolve(run__device="cpu", parallel__backend="nccl")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ConfigError, match="no GPU is visible"):
            resolve(run__device="cuda")
