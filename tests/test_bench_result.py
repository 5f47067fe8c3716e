"""The one writer of benchmark results (:mod:`shardwise.bench_result`): it fills the date, the measured machine and
the command, keeps the earlier file's notes and appends its headline to ``history``; every benchmark script writes
its JSON through it (a static check of their source); the benchmark page shows the history."""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from shardwise.bench_result import BenchRun, ResultFileError, add_machine_note, headline, machine_text

ROOT = Path(__file__).resolve().parent.parent


def _run(script: Path, argv: list[str], note: str = "", output: Path | None = None) -> BenchRun:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps")
    add_machine_note(parser)
    args = parser.parse_args([*argv, "--machine-note", note] if note else argv)
    run = BenchRun.start(str(script), argv, args, output=output)
    assert not hasattr(args, "machine_note")  # taken out: the scripts' records of their arguments stay as they were
    return run


def test_the_writer_fills_date_machine_and_command_and_carries_notes_and_history(tmp_path, monkeypatch):
    script = tmp_path / "bench" / "bench_demo.py"
    out = tmp_path / "results" / "demo.json"
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 8.0, 7.0))  # the machine busy when the run starts
    first = _run(script, ["--steps", "2"], note="idle", output=out)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 2.0, 3.0))  # and quiet when it ends
    first.write(out, {"date": "the script's own", "command": "stale", "ratio_step_time": 1.25,
                      "ours": {"step_s": [0.1, 0.2], "step_s_median": 0.15}})
    doc = json.loads(out.read_text())
    assert list(doc)[:3] == ["date", "machine", "command"] and "history" not in doc
    assert datetime.fromisoformat(doc["date"]).utcoffset().total_seconds() == 0
    assert doc["command"] == "python bench/bench_demo.py --steps 2"
    machine = doc["machine"]
    assert machine["cpus"] == os.cpu_count() and machine["note"] == "idle" and machine["cpu"]
    assert machine["torch"] and machine["ram_gib"] > 0 and "gpu" in machine
    assert machine["load_average_start"] == [9.0, 8.0, 7.0] and machine["load_average_end"] == [1.0, 2.0, 3.0]
    assert doc["ratio_step_time"] == 1.25 and doc["ours"]["step_s"] == [0.1, 0.2]

    doc["notes"] = ["measured by hand on the idle machine"]  # notes a person added to the committed file
    out.write_text(json.dumps(doc))
    _run(script, ["--steps", "3"], output=out).write(out, {"ratio_step_time": 0.9})
    second = json.loads(out.read_text())
    assert second["notes"] == ["measured by hand on the idle machine"]
    assert second["ratio_step_time"] == 0.9 and second["command"] == "python bench/bench_demo.py --steps 3"
    [earlier] = second["history"]
    assert earlier["date"] == doc["date"] and earlier["command"] == "python bench/bench_demo.py --steps 2"
    assert earlier["machine"].endswith("; idle") and earlier["figures"] == {"ratio_step_time": 1.25}

    _run(script, []).write(out, [{"rows": 1}])  # a list is kept as {"rows": [...]}
    third = json.loads(out.read_text())
    assert third["rows"] == [{"rows": 1}] and third["notes"] == second["notes"]
    assert [h["figures"] for h in third["history"]] == [{"ratio_step_time": 1.25}, {"ratio_step_time": 0.9}]
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo.json"]  # written whole: no temporary left


def test_an_unreadable_earlier_result_is_refused_before_measuring_and_kept(tmp_path):
    out = tmp_path / "broken.json"
    out.write_text('{"date": "2026-01-01", ')
    with pytest.raises(ResultFileError, match="broken.json exists but is not a JSON result"):
        _run(tmp_path / "bench" / "bench_demo.py", [], output=out)
    with pytest.raises(ResultFileError):
        _run(tmp_path / "bench" / "bench_demo.py", []).write(out, {"ratio": 1.0})
    assert out.read_text() == '{"date": "2026-01-01", '


def test_a_headline_keeps_ratios_at_any_depth_and_names_the_commit_of_the_whole_file(tmp_path):
    doc = {"date": "d", "machine": "the 2-core machine", "command": "c", "notes": ["n"], "backend": "gloo",
           "long": "x" * 100, "worlds": {"2": {"ratios": {"zero1/dp": {"step_time": 0.91234567}}}},
           "rows": [{"size": 4, "ratio_to_native": 1.5, "time_us": 3.0}], "speed": {"step_s": 2.0},
           "calibration": {"flops": 5.0}, "export": {"peak_over_shard": 2.5}}
    got = headline(doc)
    assert got["machine"] == "the 2-core machine"
    assert got["figures"] == {"worlds.2.ratios.zero1/dp.step_time": 0.9123, "rows.0.ratio_to_native": 1.5,
                              "export.peak_over_shard": 2.5, "backend": "gloo"}
    if shutil.which("git") is None:
        pytest.skip("no git here")
    path = tmp_path / "bench" / "results" / "x.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True, timeout=60)
    at = headline(doc, path)["file_at"]
    shown = subprocess.run([*git, "show", at], check=True, capture_output=True, text=True, timeout=60).stdout
    assert at.endswith(":bench/results/x.json") and json.loads(shown) == doc
    path.write_text("{}")  # changed since the commit: the commit no longer holds this file
    assert "file_at" not in headline(doc, path)


def test_a_measured_machine_reads_in_one_line():
    machine = {"host": "vm", "cpu": "AMD EPYC", "cpus": 2, "ram_gib": 23.5, "gpu": None, "torch": "2.13.0",
               "load_average_start": [3.5, 2.0, 1.0], "load_average_end": [1.25, 1.0, 1.0], "note": "shared"}
    assert machine_text(machine) == ("vm: AMD EPYC, 2 CPUs, 23.5 GiB RAM, no GPU, torch 2.13.0, load average "
                                     "3.50 / 1.25 at start / end; shared")


def test_the_benchmark_page_shows_the_machine_and_the_history(tmp_path):
    if str(ROOT / "scripts") not in sys.path:
        sys.path.append(str(ROOT / "scripts"))
    from docgen import bench_page

    path = tmp_path / "demo.json"
    run = BenchRun("python bench/bench_demo.py", note="idle")
    run.write(path, {"ratio_step_time": 1.25})
    run.write(path, {"ratio_step_time": 0.5})
    text = "\n".join(bench_page.section(path))
    assert f"- machine: {machine_text(json.loads(path.read_text())['machine'])}" in text
    assert "Earlier runs" in text and "`python bench/bench_demo.py`: ratio_step_time 1.25" in text
    assert "history" not in text.split("Earlier runs")[0]  # not also a table


# ---- every benchmark writes through the writer ------------------------------------------------------------

SCRIPTS = sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").glob("*.py"),
                  ROOT / "src" / "shardwise" / "dist" / "comm" / "bench.py"])

HAND_OFF = {("bench/gloo_collectives.py", "_rank"), ("bench/sim_calibrate.py", "_probe"),
            ("src/shardwise/dist/comm/bench.py", "_worker")}
"""(file, function) writing JSON to a temporary file its parent process reads back: not a result file."""


def _json_writes(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every ``json.dump(...)`` and every ``X.write_text(json.dumps(...))`` or
    ``f.write(json.dumps(...))``."""
    def is_json(call, name):
        return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == name \
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "json"

    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if is_json(child, "dump") or (
                    isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in ("write_text", "write") and any(is_json(a, "dumps") for a in child.args)):
                found.append((function, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def _takes_a_json_path(tree: ast.AST) -> bool:
    """An ``add_argument("--json", ...)`` that takes a value (not ``action="store_true"``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--json":
            return not any(k.arg == "action" for k in node.keywords)
    return False


def _calls(tree: ast.AST) -> set[str]:
    """``f`` for ``f(...)``, ``a.f`` for ``a.f(...)``."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            out.add(n.func.id)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name):
            out.add(f"{n.func.value.id}.{n.func.attr}")
    return out


def test_every_benchmark_writes_its_json_through_the_writer():
    """No benchmark script writes JSON by itself (only the hand-offs between processes in :data:`HAND_OFF`), and
    every one with a ``--json PATH`` option takes ``--machine-note`` and writes with ``BenchRun``."""
    stray, unrouted = [], []
    for path in SCRIPTS:
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        stray += [f"{rel}:{line} ({function})" for function, line in _json_writes(tree)
                  if (rel, function) not in HAND_OFF]
        if _takes_a_json_path(tree) and not {"add_machine_note", "BenchRun.start", "bench_run.write"} <= _calls(tree):
            unrouted.append(rel)
    assert not stray, "JSON written outside shardwise.bench_result's writer:\n" + "\n".join(stray)
    assert not unrouted, "--json without BenchRun.start / write and add_machine_note:\n" + "\n".join(unrouted)
    assert len(SCRIPTS) > 30 and sum(_takes_a_json_path(ast.parse(p.read_text())) for p in SCRIPTS) > 25
