"""``scripts/gpu_check.sh --dry-run``: the one command a lent GPU runs, run here on the CPU at tiny sizes, so it
works the first time a GPU appears. Every step runs (the GPU tests are collected and skipped), the benchmarks
write their JSON -- bench_mfu ours and the plain loop beside it, bench_offload_capacity every mode's search,
bench_dispatch our step and torch's -- and the summary lists them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_runs_every_step_and_summarises(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    assert check["ok"] and check["dry_run"]
    assert list(check["steps"]) == ["gpu_tests", "mfu", "offload_capacity", "dispatch"]
    assert check["steps"]["gpu_tests"]["tests"] == check["steps"]["gpu_tests"]["skipped"] > 10  # no CUDA here
    assert "== summary" in done.stdout and "all ok" in done.stdout

    mfu = json.loads((tmp_path / "mfu.json").read_text())
    assert mfu["smoke"] and not mfu["measured"] and mfu["parameters"] > 0
    (row,) = mfu["results"]
    assert row["variant"] == "compile-off-recompute-none"
    assert row["ours"]["tokens_per_s"] > 0 and row["plain"]["tokens_per_s"] > 0 and row["ratio_ours_over_plain"] > 0
    assert len(row["ours"]["runs"]) == 2 and all(r["timed_steps"] == 2 for r in row["ours"]["runs"])

    offload = json.loads((tmp_path / "offload_capacity.json").read_text())
    assert [r["mode"] for r in offload["results"]] == ["none", "cpu", "disk"]
    for r in offload["results"]:
        assert r["largest"]["layers"] == 2 and r["capped_at_max_layers"]  # nothing runs out of memory here
        assert [t["layers"] for t in r["trials"]] == [1, 2] and r["largest"]["tokens_per_s"] > 0
        assert r["parameters_over_no_offload"] == 1.0

    dispatch = json.loads((tmp_path / "dispatch_gpu.json").read_text())
    one = dispatch["layouts"]["one"]
    assert one["ours"]["ops"] > 100 and one["torch"]["ops"] > 100 and one["ratios"]["ops"] > 0
    sites = dispatch["dropout_sites"]
    assert sites["device_plan"]["attn_probs"]["syncs"] == 0 and sites["cpu_plan"]["law_checked_on_third"]
    assert sites["cpu_plan"]["attn_probs_at_shape"]["ops"] > 1000 * sites["device_plan"]["attn_probs"]["ops"]
