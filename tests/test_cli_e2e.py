"""The command line as a user drives it: train on 2 spawned workers, then generate and plot.

These run real subprocesses (the elastic launcher, torchrun), so they are few and tiny.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "--model.preset", "tiny", "--data.max_bytes", "300000", "--data.seq_len", "32",
    "--train.steps", "8", "--train.global_batch", "8", "--train.eval_every", "4", "--ckpt.every", "4",
    "--run.progress", "false",
]


def shardwise(*args, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardwise.cli", *args]
    if args and args[0] == "train":
        cmd += ["--data.cache_dir", str(cache)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)


def test_train_generate_plot(tmp_path):
    cache = tmp_path / "cache"
    proc = shardwise("train", *TINY, "--parallel.nproc", "2", "--run.dir", "runs/e2e", cwd=tmp_path, cache=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(0, 9))
    assert set(records[0]) == {"step", "val_loss"}, "step 0: the untrained model's validation loss"
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        assert key in records[1]
    assert "val_loss" in records[4] and "val_loss" in records[8]
    assert (run_dir / "config.toml").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
    assert any((run_dir / "tb").iterdir())

    gen = shardwise("generate", "runs/e2e", "--prompt", "import ", "--max-new-tokens", "20", cwd=tmp_path, cache=cache)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.startswith("import ") and len(gen.stdout) > len("import ")

    plot = shardwise("plot", "runs/e2e", "--out", "p.png", cwd=tmp_path, cache=cache)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corpus_too_small_is_caught_before_spawning(tmp_path):
    proc = shardwise("train", *TINY, "--parallel.nproc", "2", "--data.max_bytes", "3000",
                     "--train.global_batch", "512", "--run.dir", "runs/bad", cwd=tmp_path, cache=tmp_path / "c")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: the training corpus is too small for the batch")


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_entry(tmp_path):
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "shardwise.train", *TINY,
           "--train.steps", "3", "--run.dir", "runs/tr", "--data.cache_dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "runs" / "tr" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4  # step 0 (validation of the untrained model) and steps 1-3
