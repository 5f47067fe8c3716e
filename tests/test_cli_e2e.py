"""The command line as a user drives it: train on 2 spawned workers, then generate and plot.

These run real subprocesses (the elastic launcher, torchrun), so they are few and tiny.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.train.metrics import read_metrics

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
    records = read_metrics(run_dir)  # one record per step (a checkpoint's times merged into its step's)
    assert [r["step"] for r in records] == list(range(0, 9))
    assert set(records[0]) == {"step", "val_loss"}, "step 0: the untrained model's validation loss"
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        assert key in records[1]
    assert "val_loss" in records[4] and "val_loss" in records[8]
    assert "ckpt_stall_s" in records[4] and "ckpt_write_s" in records[8]
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
    records = read_metrics(tmp_path / "runs" / "tr")
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: validation of the untrained model


INTERRUPTED = re.compile(r"interrupted at step (\d+); the newest checkpoint is step (\d+) -- "
                         r"continue with `(shardwise train (\S+) --resume)`")


def _interrupt_once_trained(cmd: list[str], cwd: Path, run_dir: Path, past: int) -> subprocess.CompletedProcess:
    """Start ``cmd`` in a session of its own, wait (generously) until metrics.jsonl holds more than ``past``
    records and a checkpoint exists, then press Ctrl-C: SIGINT to the whole process group, as a terminal does."""
    from shardwise.train.checkpoint import list_checkpoints

    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if len(lines) > past + 1 and list_checkpoints(run_dir / "checkpoints"):
                break
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_ctrl_c_says_where_the_run_stood_and_how_to_continue(tmp_path):
    """Ctrl-C during `shardwise train` (2 workers): exit 130 and one line naming the last step, the
    newest checkpoint and the command that resumes; that command resumes from that checkpoint."""
    run_dir = tmp_path / "runs" / "ctrl-c"
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *TINY, "--train.steps", "500", "--ckpt.every", "2",
           "--parallel.nproc", "2", "--run.dir", "runs/ctrl-c", "--data.cache_dir", str(tmp_path / "cache")]
    proc = _interrupt_once_trained(cmd, tmp_path, run_dir, past=1)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]  # no traceback, no launcher noise
    match = INTERRUPTED.fullmatch(proc.stderr.strip())
    assert match, proc.stderr
    step, newest, command, config = int(match[1]), int(match[2]), match[3], match[4]
    assert step == [r["step"] for r in read_metrics(run_dir) if "loss" in r][-1]
    assert f"step_{newest:08d}" == sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1]
    assert tmp_path / config == run_dir / "config.toml" and 2 <= newest <= step < 500  # relative to the cwd

    before = len((run_dir / "metrics.jsonl").read_text().splitlines())
    resume = [sys.executable, "-m", "shardwise.cli", *shlex.split(command)[1:]]
    proc = _interrupt_once_trained(resume, tmp_path, run_dir, past=before)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert INTERRUPTED.fullmatch(proc.stderr.strip()), proc.stderr
    assert "learning-rate schedule" not in proc.stdout  # the same train.steps: nothing to warn about
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[before]["step"] == newest + 1  # the resumed run went on from that checkpoint


def test_resuming_with_other_steps_says_the_schedule_changes(tmp_path):
    """`--resume` with another train.steps keeps training, and says in one line at start-up that the
    learning rate of the steps after the checkpoint is not the original run's."""
    cache = tmp_path / "cache"
    first = shardwise("train", *TINY, "--train.steps", "4", "--train.warmup_steps", "2", "--ckpt.every", "2",
                      "--parallel.nproc", "1", "--run.dir", "runs/r", cwd=tmp_path, cache=cache)
    assert first.returncode == 0, first.stderr[-3000:]
    more = shardwise("train", "runs/r/config.toml", "--resume", "--train.steps", "6", cwd=tmp_path, cache=cache)
    assert more.returncode == 0, more.stderr[-3000:]
    warned = [line for line in more.stdout.splitlines() if "learning-rate schedule" in line]
    assert warned == ["resuming step 4 with train.steps=6 (was 4): the learning-rate schedule after step 4 "
                      "differs from the original run's"], more.stdout[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "runs/r")] == list(range(0, 7))
