"""The one writer of benchmark result files (``bench/results/*.json``): every benchmark and profiling script, and
``shardwise bench comm``, writes its JSON through :class:`BenchRun`.

A result file records when it was measured (``date``, UTC, the start of the run), on what (``machine``: measured
here -- CPU model and count, RAM, GPU, torch, the load average at the start and at the end of the run, plus an
optional ``--machine-note``) and by which invocation (``command``). It is written whole or not at all (a temporary
file renamed over it). Overwriting an earlier result keeps what the earlier file knew: its ``notes`` (how and
under what load it was measured) are carried over, and its headline -- date, machine, command and key figures,
with the git commit that holds the whole file when it is committed unchanged -- is appended to ``history``.

    parser = argparse.ArgumentParser(...)
    add_machine_note(parser)
    args = parser.parse_args(argv)
    run = BenchRun.start(__file__, argv, args, output=args.json)   # before measuring
    ...
    run.write(args.json, result)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

OWNED = ("date", "machine", "command", "notes", "history")
"""Top-level keys the writer fills; a script's own values for ``date``, ``machine`` and ``command`` are replaced,
its ``notes`` follow the earlier file's."""

DESCRIPTIVE = ("benchmark", "source", "host", "platform", "torch", "cpu_count", "cpus")
"""Top-level keys that describe a run rather than measure it: not among a headline's figures."""

MAX_FIGURES = 40
"""At most this many figures in one history entry (the ratios first); the rest are counted, and the whole file
is in git at the commit the entry names."""

MAX_TEXT = 60
"""A text field longer than this is not a headline figure."""

RATIO_WORDS = frozenset({"ratio", "ratios", "speedup", "over", "vs", "gain", "error"})
"""A key with one of these words (split at ``_``, ``/``, spaces, ...) names a comparison: the numbers under it are
headline figures (``ratio_step_time``, ``ratios.zero1/dp.step_time``, ``async_over_sync_stall``)."""

GIT_TIMEOUT_S = 10.0

SIMULATION = "a simulation: the figures do not depend on the machine that computed them"
"""The machine note of the simulator's benchmarks."""


class ResultFileError(SystemExit):
    """An existing result file that is not JSON: refused with one line (exit status 1), nothing overwritten."""


def add_machine_note(parser: argparse.ArgumentParser) -> None:
    """``--machine-note TEXT``: what the measured description of the machine cannot know (a VM, others' jobs)."""
    parser.add_argument("--machine-note", default="", metavar="TEXT",
                        help="a note on the machine, kept with the result's measured machine description "
                             "(e.g. 'idle', 'shared with other jobs')")


class BenchRun:
    """One invocation of a benchmark: what is known at its start (the command, the time, the load average) and the
    writer of its result files."""

    def __init__(self, command: str, note: str = ""):
        self.command = command
        self.note = note
        self.date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.load_average_start = load_average()

    @classmethod
    def start(cls, script: str, argv: list[str] | None, args: argparse.Namespace | None = None,
              output: str | Path | None = None, note: str = "") -> BenchRun:
        """The run of ``script`` (its ``__file__``, or a program name such as ``"shardwise bench comm"``) with
        ``argv`` (None: this process's ``sys.argv``). ``args.machine_note`` (see :func:`add_machine_note`) is
        taken out of ``args``, so the records scripts keep of their arguments stay as they were, and joins
        ``note`` (the script's own, e.g. for a simulation). An ``output`` that exists and is not JSON is refused
        now, before anything is measured."""
        user_note = ""
        if args is not None and hasattr(args, "machine_note"):
            user_note = args.machine_note or ""
            del args.machine_note
        if output is not None:
            read_result(Path(output))
        return cls(command_line(script, argv), "; ".join(n for n in (note, user_note) if n))

    def machine(self) -> dict:
        return describe_machine(self.load_average_start, self.note)

    def write(self, path: str | Path, result: dict | list) -> dict:
        """``result`` (a list is kept as ``{"rows": [...]}``) at ``path`` with this run's date, machine and
        command, the earlier file's notes and history, and the earlier file's headline appended to the history;
        written whole (a temporary file renamed). Returns what was written."""
        path = Path(path)
        previous = read_result(path)
        body = {"rows": result} if isinstance(result, list) else dict(result)
        own_notes = body.pop("notes", None)
        for key in OWNED:
            body.pop(key, None)
        doc: dict = {"date": self.date, "machine": self.machine(), "command": self.command}
        notes = _as_list(previous.get("notes")) + _as_list(own_notes) if previous else _as_list(own_notes)
        if notes:
            doc["notes"] = notes
        doc.update(body)
        if previous is not None:
            doc["history"] = list(previous.get("history") or []) + [headline(previous, path)]
        _write_whole(path, json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {path}")
        return doc


def command_line(script: str, argv: list[str] | None) -> str:
    """The invocation as a user types it: ``python bench/X.py ARGS`` (the path from the checkout's root),
    ``shardwise bench comm ARGS``; ``sudo`` in front when run as root through sudo."""
    if argv is None:
        program, argv = _program(sys.argv[0]), sys.argv[1:]
    else:
        program = _program(script)
    sudo = "sudo " if os.environ.get("SUDO_USER") and hasattr(os, "geteuid") and os.geteuid() == 0 else ""
    return sudo + " ".join([program, *(shlex.quote(str(a)) for a in argv)])


def _program(script: str) -> str:
    if " " in script:  # already a program with its subcommand
        return script
    path = Path(script)
    if path.suffix != ".py":
        return path.name
    resolved = path.resolve()
    if resolved.parent.name in ("bench", "scripts"):
        return f"python {resolved.relative_to(resolved.parent.parent)}"
    return f"python {script}"


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the OS does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def describe_machine(load_average_start: list[float] | None, note: str = "") -> dict:
    """The machine as measured here and now: host, CPU model and count, RAM, GPU (torch.cuda), torch, the
    platform, the load average given (the run's start) and now (its end), and ``note``."""
    out = {"host": platform.node(), "cpu": _cpu_model(), "cpus": os.cpu_count(), "ram_gib": _ram_gib(),
           "gpu": None, "torch": None, "python": platform.python_version(), "platform": platform.platform(),
           "load_average_start": load_average_start, "load_average_end": load_average()}
    try:
        import torch
    except ImportError:
        pass
    else:
        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            out["gpu"] = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    if note:
        out["note"] = note
    return out


def machine_text(machine) -> str | None:
    """A ``machine`` record in one line: a text as it is, a measured description (:func:`describe_machine`) as
    ``host: CPU, N CPUs, RAM, GPU, torch, load at start / end; note``."""
    if not isinstance(machine, dict):
        return str(machine) if machine else None
    parts = [f"{machine.get('cpu') or 'CPU'}, {machine.get('cpus')} CPUs"]
    if machine.get("ram_gib"):
        parts.append(f"{machine['ram_gib']} GiB RAM")
    parts.append(machine.get("gpu") or "no GPU")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    start, end = machine.get("load_average_start"), machine.get("load_average_end")
    if start or end:
        parts.append("load average " + " / ".join(f"{x[0]:.2f}" if x else "?" for x in (start, end))
                     + " at start / end")
    text = (f"{machine['host']}: " if machine.get("host") else "") + ", ".join(parts)
    return text + (f"; {machine['note']}" if machine.get("note") else "")


def read_result(path: Path) -> dict | None:
    """The result file at ``path`` as a dict (an old bare list as ``{"rows": [...]}``), None if there is none."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultFileError(f"{path} exists but is not a JSON result ({e}); move it away or fix it: the "
                              f"benchmark keeps the earlier result's notes and history there") from None
    return {"rows": doc} if isinstance(doc, list) else doc if isinstance(doc, dict) else {"value": doc}


def headline(doc: dict, path: Path | None = None) -> dict:
    """An earlier result in brief: its date, machine (one line), command and key figures -- every number under a
    key naming a comparison (:data:`RATIO_WORDS`), at any depth, then its other top-level scalars, at most
    :data:`MAX_FIGURES` -- and, when
    ``path`` is committed in git unchanged, ``file_at`` (``git show`` it for the whole earlier file)."""
    entry = {"date": doc.get("date"), "machine": machine_text(doc.get("machine")), "command": doc.get("command")}
    ratios: dict = {}
    _ratio_leaves({k: v for k, v in doc.items() if k not in OWNED}, "", False, ratios)
    scalars = {k: v for k, v in doc.items() if k not in OWNED and k not in DESCRIPTIVE and k not in ratios
               and (v is None or isinstance(v, (bool, int, float)) or isinstance(v, str) and len(v) <= MAX_TEXT)}
    figures = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in {**ratios, **scalars}.items()}
    entry["figures"] = dict(list(figures.items())[:MAX_FIGURES])
    if len(figures) > MAX_FIGURES:
        entry["figures_left_out"] = len(figures) - MAX_FIGURES
    at = committed_at(path) if path is not None else None
    if at:
        entry["file_at"] = at
    return entry


def _ratio_leaves(value, path: str, in_ratio: bool, out: dict) -> None:
    """Every number at or under a key naming a comparison, by its dotted path (list items by position; lists of
    numbers, per-step samples, left out)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _ratio_leaves(v, f"{path}.{k}" if path else str(k), in_ratio or _compares(str(k)), out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (dict, list)):
                _ratio_leaves(v, f"{path}.{i}", in_ratio, out)
    elif in_ratio and isinstance(value, (int, float)) and not isinstance(value, bool):
        out[path] = value


def _compares(key: str) -> bool:
    return not RATIO_WORDS.isdisjoint(re.split(r"[^a-z0-9]+", key.lower()))


def committed_at(path: Path) -> str | None:
    """``COMMIT:PATH`` (for ``git show``) of the last commit that wrote ``path``, when the file there is that
    version (tracked and unchanged); None otherwise, or without git."""
    where = path.resolve().parent
    if not where.is_dir():
        return None

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                                 timeout=GIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    tracked = git("ls-files", "--full-name", "--", path.name)
    if not tracked or git("status", "--porcelain", "--", path.name) != "":
        return None
    commit = git("log", "-1", "--format=%h", "--", path.name)
    return f"{commit}:{tracked}" if commit else None


def _as_list(notes) -> list:
    if not notes:
        return []
    return list(notes) if isinstance(notes, list) else [notes]


def _write_whole(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, ValueError, OSError):
        return None
