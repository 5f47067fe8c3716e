"""Training metrics: ``metrics.jsonl``, TensorBoard scalars, a progress bar, memory readings.

One JSON object per :meth:`MetricsLogger.log` call is appended to ``<run_dir>/metrics.jsonl``
(JSON Lines, https://jsonlines.org), with ``step`` first. The same numbers go to TensorBoard
(``torch.utils.tensorboard.SummaryWriter`` under ``<run_dir>/tb``) and to a ``rich`` progress
bar, or, when stdout is not a terminal, to a compact line every few steps.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["METRICS_FILE", "MetricsLogger", "read_metrics", "process_memory_bytes"]

METRICS_FILE = "metrics.jsonl"


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class MetricsLogger:
    """Writes per-step metrics to ``metrics.jsonl``, TensorBoard and the terminal.

    Only one rank should log: pass ``enabled=False`` elsewhere and every method is a no-op
    (no files are created). ``start_step`` is the step a resumed run starts from; records are
    appended to an existing ``metrics.jsonl`` and :func:`read_metrics` drops the ones a resume
    superseded.

    Args:
        run_dir: the run directory; created if missing.
        enabled: False on ranks that should not log.
        total_steps: the step the run ends at (for the bar and the print interval).
        tensorboard: also write TensorBoard scalars under ``run_dir / "tb"`` (lazily created;
            if TensorBoard cannot be imported, warn once and continue without it).
        progress: show a live ``rich`` progress bar when stdout is a terminal. Otherwise (or when
            False) print one compact line every ``print_every`` steps (default
            ``max(1, total_steps // 20)``), plus the first and the last step.
        start_step: the step training (re)starts from.
        console: the ``rich`` console to draw on (default: a new one on stdout).
        print_every: interval of the compact lines.
        warn: called with one-line warnings (default: print to stderr).
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        start_step: int = 0,
        *,
        console: Console | None = None,
        print_every: int | None = None,
        warn: Callable[[str], Any] = _warn_stderr,
    ) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps must be a non-negative int, got {total_steps!r}")
        if print_every is not None and (not isinstance(print_every, int) or print_every < 1):
            raise ValueError(f"print_every must be an int >= 1, got {print_every!r}")
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.start_step = start_step
        self._tensorboard = tensorboard
        self._warn = warn
        self._writer: Any = None
        self._file = None
        self._progress: Progress | None = None
        self._task = None
        self._closed = False
        self._printed_any = False
        self._print_every = print_every or max(1, total_steps // 20)
        if not enabled:
            return
        self._console = console or Console(soft_wrap=True)
        self._use_bar = progress and self._console.is_terminal
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        needs_newline = path.exists() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        if needs_newline:  # a crash cut the last line short: terminate it so new lines parse
            self._file.write("\n")

    # ------------------------------------------------------------------ public API

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for optimizer step ``step``."""
        if not self.enabled:
            return
        self._check_open()
        if "step" in metrics:
            raise ValueError("metrics must not contain 'step'; pass it as the first argument")
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            record[str(key)] = _plain(key, value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._log_tensorboard(record)
        self._show(record)

    def log_event(self, text: str) -> None:
        """Print one line above the progress bar (e.g. "saved checkpoint step_00000100")."""
        if not self.enabled:
            return
        console = self._progress.console if self._progress is not None else self._console
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Stop the bar and close the files; safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")

    def _log_tensorboard(self, record: Mapping[str, Any]) -> None:
        if not self._tensorboard:
            return
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                self._warn(f"TensorBoard logging disabled: {e}")
                self._tensorboard = False
                return
            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=step)

    def _show(self, record: Mapping[str, Any]) -> None:
        step = record["step"]
        stats = _format_stats(record)
        if self._use_bar:
            if self._progress is None:
                self._progress = Progress(
                    TextColumn("[bold]train"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[stats]}"),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    console=self._console,
                )
                self._task = self._progress.add_task(
                    "train", total=self.total_steps or None, completed=self.start_step, stats=""
                )
                self._progress.start()
            self._progress.update(self._task, completed=step, stats=stats)
            return
        if stats and (not self._printed_any or step % self._print_every == 0 or step == self.total_steps):
            self._printed_any = True
            self._console.print(
                f"step {step}/{self.total_steps} | {stats}", markup=False, highlight=False, soft_wrap=True
            )


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _plain(key: str, value: Any) -> Any:
    """A JSON-friendly scalar (or list of them): tensors and numpy scalars become Python numbers."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor with {value.numel()} elements; log scalars")
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (list, tuple)):  # a short vector, e.g. an MoE block's load per expert
        return [_plain(key, v) for v in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; log numbers or strings")


def _format_stats(record: Mapping[str, Any]) -> str:
    parts = []
    for key, label, fmt in (
        ("loss", "loss", "{:.4f}"),
        ("val_loss", "val_loss", "{:.4f}"),
        ("lr", "lr", "{:.2e}"),
        ("grad_norm", "grad_norm", "{:.3f}"),
        ("tokens_per_s", "tok/s", "{:,.0f}"),
    ):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{label} {fmt.format(value) if math.isfinite(value) else value}")
    return " | ".join(parts)


def read_metrics(run_dir: Path, raw: bool = False) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` in order.

    Lines that do not parse (a last line cut short by a crash, or such a line that a resumed run
    later terminated) are skipped. Unless ``raw``, one record per step: records superseded by a resume are
    dropped -- when the step goes backwards, earlier records at or after the new step are discarded, and a
    step trained again replaces its record -- and the events the trainer logs beside a step (a restart, a
    checkpoint's stall and write times) are merged into its record (the newer value of a repeated key wins).

    Raises FileNotFoundError (naming the path) if the file does not exist.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a shardwise run directory?")
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records if raw else _timeline(records)


def _timeline(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Apply the resume rules of :func:`read_metrics`; ``kept`` stays sorted by step, so both
    rules only ever touch its tail (amortised linear time)."""
    kept: list[dict[str, Any]] = []
    for record in records:
        step = record["step"]
        if kept and step < kept[-1]["step"]:
            while kept and kept[-1]["step"] >= step:
                kept.pop()
        if kept and kept[-1]["step"] == step:
            if "loss" in record and "loss" in kept[-1]:
                kept[-1] = record  # the step trained again (a resume): the new record replaces it
            else:
                kept[-1] = {**kept[-1], **record}  # an event of the same step (the newer value wins)
            continue
        kept.append(record)
    return kept


def process_memory_bytes() -> dict[str, int]:
    """Memory of this process: ``rss_bytes`` (current), ``peak_rss_bytes`` and, with CUDA,
    ``cuda_max_allocated_bytes``.

    Current RSS is read from ``/proc/self/statm`` (Linux; see proc(5)); the peak comes from
    ``resource.getrusage`` (``ru_maxrss`` is KiB on Linux, bytes on macOS; see getrusage(2)).
    Readings the platform cannot provide are left out.
    """
    out: dict[str, int] = {}
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        pass
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss_bytes"] = int(peak) * (1 if sys.platform == "darwin" else 1024)
    if torch.cuda.is_available():
        out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return out
