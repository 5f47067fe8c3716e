"""The single-GPU benchmarks without CUDA refuse a real run with one clear message, and the capacity search
doubles then bisects. (Their tiny CPU runs, ``--smoke``, are run by ``scripts/gpu_check.sh --dry-run``:
tests/test_gpu_check.py.)"""

from __future__ import annotations

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
