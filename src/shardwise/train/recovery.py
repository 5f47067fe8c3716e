"""What a restarted group does first: clean up after the failed attempt and say what was lost.

torch's elastic agent restarts every worker of the group when one fails (``run.max_restarts`` times;
TorchElastic, https://pytorch.org/docs/stable/elastic/run.html). A restarted worker is the same program
started again: it resumes from the newest checkpoint that verifies (whatever ``ckpt.resume`` says), and
global rank 0

* removes the temporary directories of checkpoints that were being written when the group died
  (every writer of this run belongs to this group, which is now starting, so none is in use);
* logs the restart in ``metrics.jsonl`` (``restart``: the attempt, ``steps_lost``: steps the failed
  attempt had finished past that checkpoint, ``cause``: the first error a worker recorded, see
  :mod:`shardwise.dist.diagnose`) and on the console.

A failure that ended the last two attempts the same way -- the same rank, the same error text -- is not
transient (a bug, bad data, a NaN): restarting again would only repeat it. Every worker of the next
attempt sees that in ``failures.jsonl`` (:func:`repeated_failure`), writes ``gave_up.json`` and exits
without training, and the launcher reports the failure (:mod:`shardwise.launch`). A SIGKILLed worker
records nothing, so kills are always retried.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.train.checkpoint import TMP_PREFIX
from shardwise.train.faults import restart_attempt
from shardwise.train.metrics import read_metrics

FAILURES_FILE = "failures.jsonl"
"""One JSON line per worker failure that raised (launch, attempt, rank, error); a SIGKILLed worker writes none."""
GAVE_UP_FILE = "gave_up.json"
"""Written by the workers of an attempt that did not run because the failure before repeated itself."""


def launch_id() -> str | None:
    """The elastic agent's run id of this launch (``TORCHELASTIC_RUN_ID``); attempts restart at 0 per launch."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def resume_wanted(ckpt_resume: bool) -> bool:
    """A run resumes when asked to, and always after the agent restarted the group."""
    return ckpt_resume or restart_attempt() > 0


def clean_partial_checkpoints(root: Path, log: Callable[[str], Any]) -> list[str]:
    """Remove the ``.tmp-*`` directories under ``root`` (checkpoints whose writers died); their names."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.name.startswith(TMP_PREFIX) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    if removed:
        log(f"removed {len(removed)} partial checkpoint(s) left by a failed write: {', '.join(removed)}")
    return removed


def last_logged_step(run_dir: Path) -> int | None:
    """The step of the last training record in ``metrics.jsonl`` as written (before a resume rewinds it)."""
    try:
        records = read_metrics(run_dir, raw=True)
    except FileNotFoundError:
        return None
    steps = [r["step"] for r in records if "loss" in r]
    return steps[-1] if steps else None


def record_failure(run_dir: Path, rank: int, error: str) -> None:
    """Append this worker's failure to ``failures.jsonl`` (one short line; O_APPEND keeps lines whole)."""
    line = json.dumps({"launch": launch_id(), "attempt": restart_attempt(), "rank": rank, "error": error}) + "\n"
    try:
        with open(Path(run_dir) / FAILURES_FILE, "a", encoding="utf-8") as f:
            f.write(line)
    except OSError:
        pass  # a diagnostic only


def failures(run_dir: Path, attempt: int | None = None) -> list[dict]:
    """The recorded failures (of one attempt, if given); inside a launch only that launch's."""
    path = Path(run_dir) / FAILURES_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or launch_id() not in (None, rec.get("launch")):
            continue
        if attempt is None or rec.get("attempt") == attempt:
            out.append(rec)
    return out


def repeated_failure(run_dir: Path) -> str | None:
    """The failure that ended both of the last two attempts (the first one each recorded: same rank, same
    error), or None; on attempts 0 and 1 always None."""
    attempt = restart_attempt()
    if attempt < 2:
        return None
    last, before = failures(run_dir, attempt - 1), failures(run_dir, attempt - 2)
    if not last or not before or (last[0]["rank"], last[0]["error"]) != (before[0]["rank"], before[0]["error"]):
        return None
    return (f"rank {last[0]['rank']} failed the same way in attempts {attempt - 2} and {attempt - 1}, so it is not "
            f"transient and the group was not restarted again: {last[0]['error']}")


def give_up(run_dir: Path, cause: str) -> None:
    """Record that this attempt stopped before training because of ``cause`` (every worker writes the same)."""
    path = Path(run_dir) / GAVE_UP_FILE
    tmp = path.with_name(f".{GAVE_UP_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"launch": launch_id(), "cause": cause}), encoding="utf-8")
    os.replace(tmp, path)


def note_restart(log, run_dir: Path, start_step: int, max_restarts: int) -> dict | None:
    """On global rank 0 of a restarted group: log the restart record (at the first step this attempt
    runs, so the failed attempt's records past the checkpoint are superseded) and one console line."""
    attempt = restart_attempt()
    if attempt == 0:
        return None
    last = last_logged_step(run_dir)
    lost = max(0, last - start_step) if last is not None else 0
    causes = failures(run_dir, attempt - 1)
    cause = f"rank {causes[0]['rank']}: {causes[0]['error']}" if causes else \
        "a worker died without an error (killed by a signal?)"
    record = {"restart": attempt, "steps_lost": lost, "resumed_step": start_step, "cause": cause}
    log.log(start_step + 1, record)
    log.log_event(f"restart {attempt} of {max_restarts}: resumed at step {start_step}, {lost} step(s) lost; "
                  f"cause: {cause}")
    return record
