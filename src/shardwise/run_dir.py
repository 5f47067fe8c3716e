"""What a run directory may hold, and when: one run per directory, a resume checked before any worker starts.

A run directory holds one run: its resolved ``config.toml``, ``metrics.jsonl``, ``checkpoints/``, ``failures.jsonl``
... (:mod:`shardwise.launch`). Two runs must never mix: training into a directory that already holds a run
(without ``--resume``) would overwrite its config and the checkpoints of equal steps, append a second run's
records to its metrics and leave an older run's later checkpoint as the "newest". So the launcher refuses it
here, in one line, before anything is written. A resume is checked here too, before any worker starts and
before ``config.toml`` is rewritten: the directory must exist and hold a checkpoint whose structure checks out
-- its manifest, every listed file present with its recorded size, ``state.json`` intact -- and the
checkpoint's tensors must have the shapes the config's model has (``state.json`` indexes them) -- a resume
that cannot work fails in one line and leaves the run as it was. No shard is read here: each node's launcher
would read the whole checkpoint again; the workers verify every tensor they load, each its share, and agree on
the checkpoint they resume from (:mod:`shardwise.train.resume`).

Checkpoints that fail verification are never overwritten or deleted: once a valid one is chosen, each newer,
broken one is renamed aside (``step_00000006.corrupt``), where no later save of that step and no pruning
touches it (:func:`shardwise.train.checkpoint.set_aside`).

``runs/latest`` points at the newest run that wrote a checkpoint: a run that fails before its first checkpoint
leaves it where it was (:class:`LatestLink`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from shardwise.config import Config, ConfigError

CONFIG_FILE = "config.toml"
RUN_FILES = ("metrics.jsonl", "checkpoints", "failures.jsonl", "gave_up.json", "tb", "ps")
"""What a run leaves in its directory once its workers start (``config.toml`` and the tokenizer are written
before, so a directory with only those is a run that never started, and may be trained into)."""


def check_path(run_dir: Path, name: str = "run.dir") -> None:
    """ConfigError unless ``run_dir`` is a directory or can be created as one (no file in the way); ``name`` is
    the field or argument that gave it."""
    run_dir = Path(run_dir)
    for path in (run_dir, *run_dir.parents):
        if path.exists() and not path.is_dir():
            what = "is" if path == run_dir else f"is inside {path}, which is"
            raise ConfigError(f"{name}={str(run_dir)!r} {what} a file, not a directory; give a directory path")


def started_run(run_dir: Path) -> str | None:
    """The first file or directory in ``run_dir`` that a started run leaves there, or None."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and any(path.iterdir()) or path.is_file():
            return name
    return None


def check_new_run(run_dir: Path) -> None:
    """ConfigError when ``run_dir`` already holds a run (trained into without ``--resume``)."""
    found = started_run(run_dir)
    if found is not None:
        raise ConfigError(f"run.dir={str(run_dir)!r} already holds a run ({found}); continue it with `shardwise "
                          f"train {run_dir / CONFIG_FILE} --resume`, or give a new run.dir")


def check_resume(run_dir: Path, cfg: Config, log=print) -> Path:
    """The checkpoint a resume of ``run_dir`` will start from (the newest whose structure checks out:
    :func:`~shardwise.train.checkpoint.verify_structure`, no tensor file read; the workers may still fall back
    together from one whose bytes do not verify), after checking that ``cfg``'s model has the checkpoint's
    shapes; each newer, broken checkpoint is renamed aside and named through ``log``. ConfigError, with nothing
    changed, when there is nothing to resume or it does not fit."""
    from shardwise.train.checkpoint import CheckpointError, list_checkpoints, set_aside, verify_structure
    from shardwise.train.state import resume_mismatch

    root = run_dir / "checkpoints"
    if not run_dir.is_dir():
        raise ConfigError(f"ckpt.resume=true but run.dir={str(run_dir)!r} does not exist: nothing to resume "
                          "(drop --resume to start a new run)")
    found = list_checkpoints(root)
    if not found:
        raise ConfigError(f"ckpt.resume=true but {root} holds no checkpoint: nothing to resume (drop --resume "
                          "and give a new run.dir to start again)")
    corrupt: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            verify_structure(path)
        except CheckpointError as e:
            corrupt.append((path, str(e)))
            continue
        problem = resume_mismatch(path, cfg)
        if problem is not None:
            raise ConfigError(f"ckpt.resume=true but {problem}; resume with the run's own settings "
                              f"({run_dir / CONFIG_FILE}) or give a new run.dir")
        for bad, why in corrupt:
            try:
                log(f"set aside a corrupt checkpoint as {set_aside(bad).name}: {why}")
            except OSError:
                pass  # another node's launcher of the same run set it aside first
        return path
    raise ConfigError(f"ckpt.resume=true but none of the {len(found)} checkpoint(s) in {root} verifies (newest: "
                      f"{corrupt[0][1]}); they are left as they are")


def write_config(run_dir: Path, text: str) -> None:
    """Write ``run_dir/config.toml`` atomically (a temporary file renamed over it)."""
    path = run_dir / CONFIG_FILE
    tmp = run_dir / f".{CONFIG_FILE}.{os.getpid()}"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def point_latest(run_dir: Path) -> None:
    """Make ``<parent>/latest`` a link to ``run_dir`` (atomically replaced; a convenience only)."""
    latest = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest-{os.getpid()}"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, latest)
    except OSError:
        pass


class LatestLink:
    """While a run trains, point ``runs/latest`` at it as soon as its first checkpoint exists (a thread polling
    ``checkpoints/`` every ``poll_s`` seconds, and once more when the run ends); never before, so a run that
    fails before its first checkpoint leaves the link at the previous run. A context manager."""

    def __init__(self, run_dir: Path, enabled: bool = True, poll_s: float = 1.0):
        self.run_dir, self.enabled, self.poll_s = Path(run_dir), enabled, poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pointed = False

    def _check(self) -> bool:
        from shardwise.train.checkpoint import list_checkpoints

        if not self.pointed and list_checkpoints(self.run_dir / "checkpoints"):
            point_latest(self.run_dir)
            self.pointed = True
        return self.pointed

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s) and not self._check():
            pass

    def __enter__(self) -> LatestLink:
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="runs-latest", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._check()
