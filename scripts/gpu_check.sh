#!/usr/bin/env bash
# One command for a lent GPU: the GPU tests and the single-GPU benchmarks, in at most 8 minutes, with their JSON
# under bench/results/ and one summary at the end.
#
#   scripts/gpu_check.sh                 # on a machine with a CUDA GPU
#   scripts/gpu_check.sh --dry-run --out /tmp/x   # the same steps on the CPU at tiny sizes (tests/test_gpu_check.py)
#
# Steps, each under its own time limit (together 8 minutes):
#   1. tests/test_gpu.py (pytest -m gpu)                                   210 s   -> gpu_tests.xml
#   2. bench/bench_mfu.py, compile off, recompute none, 10 timed steps      120 s   -> mfu.json
#   3. bench/bench_offload_capacity.py, no offload and CPU offload, d 1024,
#      up to 2 layers: the path runs (the full capacity search is hours)     90 s   -> offload_capacity.json
#   4. bench/bench_dispatch.py --device cuda: operators and host
#      synchronisations of one step, ours vs torch's, one process           60 s   -> dispatch_gpu.json
# then gpu_check.json (every step's status and seconds) and the summary. Exit status 0 when every step passed.
# With --dry-run the GPU tests are collected and skipped (no CUDA), the benchmarks run with --smoke (dispatch:
# the CPU, layout "one"), and nothing is written under bench/results/ unless --out says so.
set -u

DRY=0
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) shift; OUT="${1:?--out needs a directory}" ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --out DIR)" >&2; exit 2 ;;
    esac
    shift
done

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "$OUT" ]; then
    if [ "$DRY" = 1 ]; then OUT="$(mktemp -d)"; else OUT="$ROOT/bench/results"; fi
fi
mkdir -p "$OUT" || exit 2
CACHE="$(mktemp -d)"
trap 'rm -rf "$CACHE"' EXIT

if [ "$DRY" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: torch.cuda.is_available() is False here; run it on a machine with a CUDA GPU, or with --dry-run" >&2
    exit 2
fi

STATUS="$OUT/gpu_check.steps"
: > "$STATUS"
step() {  # step NAME LIMIT_S COMMAND...: run it under its limit, its output in OUT/NAME.log, its status recorded
    local name="$1" limit="$2"
    shift 2
    local t0
    t0=$(date +%s)
    echo "== $name (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $(( $(date +%s) - t0 )) $limit" >> "$STATUS"
    tail -n 3 "$OUT/$name.log"
}

if [ "$DRY" = 1 ]; then
    step gpu_tests 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py --junitxml="$OUT/gpu_tests.xml"
    step mfu 240 "$PY" bench/bench_mfu.py --smoke --recompute none --json "$OUT/mfu.json" --cache-dir "$CACHE"
    step offload_capacity 240 "$PY" bench/bench_offload_capacity.py --smoke --json "$OUT/offload_capacity.json" \
        --cache-dir "$CACHE"
    step dispatch 240 "$PY" bench/bench_dispatch.py --device cpu --layouts one --json "$OUT/dispatch_gpu.json" \
        --cache-dir "$CACHE"
else
    step gpu_tests 210 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py --junitxml="$OUT/gpu_tests.xml"
    step mfu 120 "$PY" bench/bench_mfu.py --compile off --recompute none --steps 10 --warmup 3 \
        --json "$OUT/mfu.json" --cache-dir "$CACHE"
    step offload_capacity 90 "$PY" bench/bench_offload_capacity.py --offload none cpu --d-model 1024 --heads 8 \
        --max-layers 2 --steps 2 --warmup 1 --trial-timeout 40 --json "$OUT/offload_capacity.json" --cache-dir "$CACHE"
    step dispatch 60 "$PY" bench/bench_dispatch.py --device cuda --json "$OUT/dispatch_gpu.json" --cache-dir "$CACHE"
fi

"$PY" - "$OUT" "$DRY" <<'EOF'
"""The summary: one line per step, then gpu_check.json."""
import datetime
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
steps = {}
for line in (out / "gpu_check.steps").read_text().splitlines():
    name, rc, seconds, limit = line.split()
    steps[name] = {"exit_status": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                   "timed_out": int(rc) in (124, 137), "log": str(out / f"{name}.log")}


def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None


lines = []
if (out / "gpu_tests.xml").is_file():
    suite = ET.parse(out / "gpu_tests.xml").getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    got = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    steps["gpu_tests"].update(got)
    lines.append(f"gpu tests: {got['tests'] - got['failures'] - got['errors'] - got['skipped']} passed, "
                 f"{got['failures'] + got['errors']} failed, {got['skipped']} skipped")
mfu = load("mfu.json")
if mfu:
    for row in mfu["results"]:
        m = row["ours"].get("mfu")
        lines.append(f"mfu {row['variant']}: ours {row['ours']['tokens_per_s']:.0f} tok/s"
                     + (f" (MFU {m:.1%})" if m else "") + f", ours/plain {row['ratio_ours_over_plain']:.3f}")
cap = load("offload_capacity.json")
if cap:
    for r in cap["results"]:
        g = r["largest"]
        lines.append(f"offload {r['mode']}: " + (f"{g['layers']} layers ({g['parameters'] / 1e6:.0f}M) trained, "
                                                 f"{g['tokens_per_s']:.0f} tok/s" if g else "nothing trained"))
disp = load("dispatch_gpu.json")
if disp:
    for name, row in disp["layouts"].items():
        o, t = row["ours"], row.get("torch") or {}
        lines.append(f"dispatch {name}: ops ours/torch {o['ops']}/{t.get('ops', '-')}, host syncs "
                     f"{o['syncs']}/{t.get('syncs', '-')} {o['syncs_by_kind'] or ''}")
ok = all(s["exit_status"] == 0 for s in steps.values())
summary = {"check": "gpu_check", "dry_run": dry, "ok": ok,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.node(), "command": "scripts/gpu_check.sh" + (" --dry-run" if dry else ""),
           "total_s": sum(s["seconds"] for s in steps.values()), "steps": steps, "summary": lines}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
print("== summary" + (" (dry run: CPU, tiny sizes, measures nothing)" if dry else ""))
for name, s in steps.items():
    state = "ok" if s["exit_status"] == 0 else "TIMED OUT" if s["timed_out"] else f"FAILED ({s['exit_status']})"
    print(f"{name:17s} {state:12s} {s['seconds']:4d} s of {s['limit_s']} s")
for line in lines:
    print("  " + line)
print(f"{'all ok' if ok else 'NOT ok'} in {summary['total_s']} s; wrote {out / 'gpu_check.json'}")
sys.exit(0 if ok else 1)
EOF
