"""MetricsLogger / read_metrics / process_memory_bytes, and plot_runs."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
from rich.console import Console

from shardwise.plot import plot_runs
from shardwise.train.metrics import MetricsLogger, process_memory_bytes, read_metrics


def _quiet(**kw) -> Console:
    return Console(file=io.StringIO(), **kw)


def test_jsonl_written_flushed_and_readable(tmp_path):
    console = _quiet()
    log = MetricsLogger(tmp_path, enabled=True, total_steps=10, tensorboard=False, console=console)
    for step in range(1, 11):
        log.log(step, {"loss": 5.0 / step, "lr": torch.tensor(1e-3), "tokens_per_s": 1000 + step, "note": "x"})
        # flushed per line: readable before close
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == step
    log.log_event("saved checkpoint step_00000010")
    log.close()
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert list(json.loads(lines[0])) == ["step", "loss", "lr", "tokens_per_s", "note"]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[0]["lr"] == pytest.approx(1e-3) and isinstance(records[0]["lr"], float)
    out = console.file.getvalue()
    # not a terminal: compact lines at the first step, every max(1, 10 // 20) = 1 step
    assert "step 1/10 | loss 5.0000 | lr 1.00e-03 | tok/s 1,001" in out
    assert "saved checkpoint step_00000010" in out
    with pytest.raises(RuntimeError, match="closed"):
        log.log(11, {"loss": 1.0})


def test_compact_lines_interval(tmp_path):
    console = _quiet()
    with MetricsLogger(tmp_path, True, total_steps=45, tensorboard=False, console=console) as log:
        for step in range(1, 46):
            log.log(step, {"loss": 1.0})
    printed = [int(line.split()[1].split("/")[0]) for line in console.file.getvalue().splitlines()]
    assert printed == [1, 2, *range(4, 45, 2), 45]


def test_progress_bar_on_terminal(tmp_path):
    console = _quiet(force_terminal=True, width=120)
    with MetricsLogger(tmp_path, True, total_steps=3, tensorboard=False, console=console) as log:
        for step in range(1, 4):
            log.log(step, {"loss": 2.0, "lr": 1e-4, "tokens_per_s": 5e4})
        log.log_event("an event line")
    out = console.file.getvalue()
    assert "3/3" in out and "an event line" in out and "tok/s 50,000" in out


def test_truncated_last_line_tolerated_and_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    with MetricsLogger(tmp_path, True, 10, tensorboard=False, progress=False, start_step=2, console=_quiet()) as log:
        log.log(3, {"loss": 2.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 3.0), (2, 2.5), (3, 2.0)]


def test_resume_supersedes_abandoned_records(tmp_path):
    rows = [(1, "loss"), (2, "loss"), (2, "val_loss"), (3, "loss"), (4, "loss"), (2, "loss"), (3, "loss")]
    lines = [json.dumps({"step": s, k: float(i)}) + "\n" for i, (s, k) in enumerate(rows)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    assert len(read_metrics(tmp_path, raw=True)) == 7
    # a resume from step 1 re-logs step 2: every old record from step 2 on belongs to the abandoned timeline
    assert [(r["step"], next(iter(r.keys() - {"step"}))) for r in read_metrics(tmp_path)] == [
        (1, "loss"),
        (2, "loss"),
        (3, "loss"),
    ]
    # the events of a step merge into its record; a late report of a key the step already holds wins
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 5, "loss": 1.0, "ckpt_write_s": 0.5}\n{"step": 5, "val_loss": 2.0}\n'
        '{"step": 5, "ckpt_stall_s": 0.1}\n{"step": 5, "ckpt_write_s": 0.7}\n')
    assert read_metrics(tmp_path) == [
        {"step": 5, "loss": 1.0, "val_loss": 2.0, "ckpt_stall_s": 0.1, "ckpt_write_s": 0.7}]
    # a step trained again (loss logged twice at one step) replaces the old record
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0, "lr": 3.0}\n{"step": 5, "loss": 2.0}\n')
    assert read_metrics(tmp_path) == [{"step": 5, "loss": 2.0}]


def test_disabled_logger_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    log = MetricsLogger(run_dir, enabled=False, total_steps=5)
    log.log(1, {"loss": 1.0})
    log.log_event("nothing")
    log.close()
    assert not run_dir.exists()


def test_tensorboard_event_files(tmp_path):
    with MetricsLogger(tmp_path, True, total_steps=2, progress=False, console=_quiet()) as log:
        log.log(1, {"loss": 1.5, "lr": 1e-3, "note": "skipped"})
        log.log(2, {"loss": 1.25, "lr": 1e-3})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_tensorboard_import_failure_warns_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    warnings: list[str] = []
    with MetricsLogger(tmp_path, True, 2, progress=False, console=_quiet(), warn=warnings.append) as log:
        log.log(1, {"loss": 1.0})
        log.log(2, {"loss": 0.5})
    assert len(warnings) == 1 and "TensorBoard" in warnings[0]
    assert len(read_metrics(tmp_path)) == 2 and not (tmp_path / "tb").exists()


def test_bad_metric_values(tmp_path):
    with MetricsLogger(tmp_path, True, 2, tensorboard=False, console=_quiet()) as log:
        with pytest.raises(TypeError, match="'bad'"):
            log.log(1, {"bad": {"a": 1}})
        with pytest.raises(TypeError, match="'bad'"):
            log.log(1, {"bad": [1, object()]})
        log.log(1, {"load": [1, 2.5]})  # a short vector of numbers (an MoE block's load per expert) is fine
        with pytest.raises(ValueError, match="step"):
            log.log(1, {"step": 3})
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "nope")


def test_process_memory_bytes():
    mem = process_memory_bytes()
    assert mem["rss_bytes"] > 1 << 20
    assert mem["peak_rss_bytes"] >= mem["rss_bytes"] // 2


def _fake_run(run_dir, scale: float, val: bool) -> None:
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, 51):
            rec = {
                "step": step,
                "loss": scale * 4 / step**0.5,
                "lr": 1e-3 * min(1, step / 10),
                "grad_norm": 1 / step,
                "tokens_per_s": 1e4 * scale,
            }
            f.write(json.dumps(rec) + "\n")
            if val and step % 10 == 0:
                f.write(json.dumps({"step": step, "val_loss": scale * 4.2 / step**0.5}) + "\n")


def test_plot_two_runs(tmp_path):
    a, b = tmp_path / "run-a", tmp_path / "run-b"
    _fake_run(a, 1.0, val=True)
    _fake_run(b, 1.3, val=False)
    out = plot_runs([a, b], tmp_path / "plots" / "cmp.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_plot_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no metrics.jsonl"):
        plot_runs([empty], tmp_path / "x.png")
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics"):
        plot_runs([empty], tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one"):
        plot_runs([], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
