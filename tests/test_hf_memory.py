"""Peak memory of the streamed export and the sliced import, measured with the resource module in fresh processes
(``bench/bench_hf_memory.py --quick``, whose full-size figures the README quotes): the export of a model 10 shards
big grows the process by less than 2 shards; on 4 fresh ZeRO-3 ranks starting from a transformers directory 4x
each rank's share, every rank's peak stays within its share + one largest tensor (+ the allocator's allowance)
above what it held before the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers", reason="the benchmark writes transformers directories' config files only, but "
                    "shares the HF extra's requirements")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is reset through /proc/self/clear_refs")
def test_export_and_import_peak_memory_in_fresh_processes(tmp_path):
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_hf_memory.py"), "--quick", "--layouts", "zero3", "--json",
           str(out), "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    export = report["export"]
    assert export["model_over_shard"] >= 8 and export["growth_over_shard"] < 2, proc.stdout
    assert len(export["files"]) >= 10  # Hub-style shards of at most 10 MB
    ranks = report["import"]["zero3"]
    assert len(ranks) == 4 and all(r["model_bytes"] >= 3 * r["params_bytes"] for r in ranks)
    assert all(r["ok"] for r in ranks), proc.stdout
    assert proc.returncode == 0, proc.stdout
