"""Bad input gets one line that names the flag or field, the value and what is valid (exit 2), and leaves
nothing behind: the misuses a new user tried (issue 25) that used to fail otherwise."""

from __future__ import annotations

import pytest

from shardwise.cli import main
from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve


def _cli_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(("flags", "fragment"), [
    (("--max-new-tokens", "-1"), "--max-new-tokens -1: give at least 1"),
    (("--top-k", "0"), "--top-k 0: give at least 1"),
    (("--prompt", ""), '--prompt "": every prompt needs at least one character'),
    (("--temperature", "-0.5"), "--temperature -0.5: give 0 (greedy) or more"),
])
def test_generate_names_a_bad_flag(capsys, tmp_path, flags, fragment):
    assert fragment in _cli_error(capsys, "generate", str(tmp_path / "no-run"), *flags)


def test_an_export_directory_that_is_a_file_is_named(capsys, tmp_path):
    (tmp_path / "out").write_text("x")
    line = _cli_error(capsys, "export", str(tmp_path / "run"), str(tmp_path / "out" / "hf"), "--format", "hf")
    assert f"OUT_DIR='{tmp_path / 'out' / 'hf'}' is inside {tmp_path / 'out'}, which is a file" in line


def test_plan_refuses_zero_nodes(capsys):
    assert "--nodes (cluster.nodes)=0 must be a positive integer" in _cli_error(
        capsys, "plan", "--model.preset", "tiny", "--cluster.nodes", "0")


def _refusal(**overrides) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(Config.load(overrides={k: str(v) for k, v in overrides.items()}), tokenizer_vocab=257)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"parallel.nproc": 3, "ps.servers": 1, "parallel.cp": 2},
     "ps.servers=1 with parallel.cp=2: the parameter server's workers hold whole replicas"),
    ({"parallel.nproc": 3, "ps.servers": 1, "train.precision": "fp16"},
     "ps.servers=1 with train.precision='fp16': the loss scaler's skipped steps"),
    ({"train.steps": "true"}, "train.steps=true is not an integer"),
    ({"parallel.sequence_parallel": 3}, "parallel.sequence_parallel=3 is not true or false"),
    ({"parallel.zero_quant_weights": "true"}, "parallel.zero_quant_weights=true quantizes"),
    ({"parallel.nproc": 2, "parallel.cp": 2, "data.seq_len": 30},
     "does not divide into 4 chunks (parallel.cp=2, parallel.cp_balance='headtail'); use a multiple of 4, e.g. "
     "28 or 32"),
])
def test_config_refusals_read_as_the_user_wrote(overrides, expected):
    message = _refusal(**overrides)
    assert expected in message, message
    assert "init_from" not in message and "zb-h1" not in message and "True" not in message


def test_a_corpus_that_fails_leaves_no_lock_file(tmp_path):
    """A .jsonl line that is not JSON is named with its column, and the token cache holds nothing after it."""
    from shardwise.data import DataError, prepare_corpus

    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "fine"}\n{"text": "cut\n')
    cfg = Config.load(overrides={"data.source": str(source), "data.cache_dir": str(tmp_path / "cache")}).data
    with pytest.raises(DataError, match=r"line 2 of .*bad.jsonl is not valid JSON: Invalid control character at "
                                        r"column \d+$"):
        prepare_corpus(cfg)
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(("checks", "overrides", "fragment"), [
    ("shardwise.ps.checks", {"ps.servers": 1}, "ps.servers=1 with run.device='cuda': the parameter server's "
                                               "pushes and pulls are gloo point-to-point"),
    ("shardwise.parallel.context.checks", {"parallel.cp": 2, "data.seq_len": 32},
     "parallel.cp_algorithm='ring' with run.device='cuda' and parallel.backend='gloo'"),
    ("shardwise.parallel.expert.checks",
     {"parallel.ep": 2, "parallel.dp": 2, "model.n_experts": 4, "comm.algorithm": "ring"},
     "parallel.ep=2 with run.device='cuda' and parallel.backend='gloo': our pairwise all-to-all"),
    ("shardwise.parallel.zero.checks", {"parallel.zero": 2, "parallel.dp": 2},
     "parallel.zero=2 with run.device='cuda' and parallel.backend='gloo': ZeRO reduce-scatters"),
    ("shardwise.dist.comm.checks", {"comm.algorithm": "ring", "parallel.dp": 2},
     "comm.algorithm='ring' with run.device='cuda' and parallel.backend='gloo': our all-reduce algorithms"),
    ("shardwise.dist.comm.checks", {"comm.compression": "topk", "parallel.dp": 2},
     "comm.compression='topk' with run.device='cuda' and parallel.backend='gloo': it all-gathers"),
])
def test_cuda_tensors_on_gloo_point_to_point_are_refused(checks, overrides, fragment):
    """gloo's point-to-point takes CPU tensors, and of the collectives only all-reduce and broadcast take CUDA
    tensors: the ring, our pairwise all-to-all, the parameter server, ZeRO, and our all-reduce algorithms and
    compressions refuse run.device='cuda' on gloo (each technique's check, a function of the config: run here
    directly, since resolving would first refuse 'cuda' on a machine without a GPU)."""
    import importlib

    cfg = Config.load(overrides={"run.device": "cuda", "parallel.backend": "gloo", "parallel.nproc": "2",
                                 **{k: str(v) for k, v in overrides.items()}})
    with pytest.raises(ConfigError, match=fragment):
        importlib.import_module(checks).check(cfg)
    cfg.run.device = "cpu"
    importlib.import_module(checks).check(cfg)
