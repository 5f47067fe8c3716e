"""The single-GPU benchmarks run end to end (``--smoke``: a tiny model on the CPU, through our trainer
and, for bench_mfu, the plain PyTorch loop beside it), write their JSON, and without CUDA refuse a real
run with one clear message. They measure nothing here; the GPU figures come from a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def test_bench_mfu_smoke_writes_ours_and_the_plain_loop(tmp_path, cache_dir):
    out = tmp_path / "mfu.json"
    done = _run("bench_mfu.py", "--smoke", "--recompute", "none", "--json", str(out), "--cache-dir", str(cache_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["smoke"] and not got["measured"] and got["parameters"] > 0
    (row,) = got["results"]
    assert row["variant"] == "compile-off-recompute-none"
    assert row["ours"]["tokens_per_s"] > 0 and row["plain"]["tokens_per_s"] > 0 and row["ratio_ours_over_plain"] > 0
    assert len(row["ours"]["runs"]) == 2 and all(r["timed_steps"] == 2 for r in row["ours"]["runs"])


def test_bench_offload_capacity_smoke_searches_every_mode(tmp_path, cache_dir):
    out = tmp_path / "offload.json"
    done = _run("bench_offload_capacity.py", "--smoke", "--json", str(out), "--cache-dir", str(cache_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert [r["mode"] for r in got["results"]] == ["none", "cpu", "disk"]
    for r in got["results"]:
        assert r["largest"]["layers"] == 2 and r["capped_at_max_layers"]  # nothing runs out of memory here
        assert [t["layers"] for t in r["trials"]] == [1, 2] and r["largest"]["tokens_per_s"] > 0
        assert r["parameters_over_no_offload"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("script", ["bench_mfu.py", "bench_offload_capacity.py"])
def test_without_cuda_a_real_run_exits_with_one_clear_line(script):
    done = _run(script, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "torch.cuda.is_available() is False" in done.stderr and "--smoke" in done.stderr


def test_offload_capacity_search_doubles_then_bisects(monkeypatch):
    """The search over layers, with a fake trial that trains up to 5 layers: 1, 2, 4, 8 (fails), then
    6 (fails), 5; and a cap it never reaches the failure under."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_offload_capacity", BENCH / "bench_offload_capacity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "run_trial", lambda args, mode, layers, work: {
        "layers": layers, "parameters": layers * 10, "fits": layers <= 5, "tokens_per_s": 100.0 / layers,
        "error": "out of memory"})
    got = bench.largest(argparse.Namespace(max_layers=256), "cpu", Path("."))
    assert [t["layers"] for t in got["trials"]] == [1, 2, 4, 8, 6, 5]
    assert got["largest"]["layers"] == 5 and got["first_failure_layers"] == 6 and not got["capped_at_max_layers"]
    capped = bench.largest(argparse.Namespace(max_layers=3), "cpu", Path("."))
    assert [t["layers"] for t in capped["trials"]] == [1, 2, 3] and capped["largest"]["layers"] == 3
    assert capped["capped_at_max_layers"]
