"""Benchmark: the largest GPT our trainer trains on one GPU without offload, with ``parallel.offload cpu``
and with ``parallel.offload disk``, and the tokens/s of each (ZeRO-Offload's headline, Ren et al. 2021
§6: a 10B model on one 32 GB V100; ZeRO-Infinity's, Rajbhandari et al. 2021 §7, with NVMe).

Models are GPT-2-flavour ``shardwise.model.Transformer`` of width ``--d-model`` and a growing number
of layers. For each mode the number of layers doubles from 1 until a run fails (out of GPU or host
memory, or past ``--trial-timeout``), then is bisected between the last that trained and the first
that did not. Each trial is one fresh process running our trainer (``shardwise.train.loop.train``,
as ``shardwise train`` runs it) for ``--warmup + --steps`` steps with activation recomputation (so the
limit is the model states, not the activations); it "trains" when every step finished with a finite
loss. tokens/s is the trainer's own median over the timed steps.

Modes: ``none`` -- the data-parallel engine on one rank (fp32 weights, gradients and Adam moments on
the GPU); ``cpu`` -- ZeRO-2 with ``parallel.offload cpu`` (masters, moments and the optimizer step on
the CPU; gradients copied out into pinned memory on a side stream); ``disk`` -- ZeRO-3 with
``parallel.offload disk`` (masters and moments in files under ``--offload-dir``, streamed per unit).

    python bench/bench_offload_capacity.py                       # every mode, d_model 2048
    python bench/bench_offload_capacity.py --offload cpu --d-model 4096 --heads 32 --offload-dir /nvme/x
    python bench/bench_offload_capacity.py --smoke               # tiny, CPU, in-process: checks the script only

Without CUDA it exits with status 2 and says so (``--smoke`` runs on CPU). Target (issue 13): >= 4x
the parameters with CPU offload -- not measured yet.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_bench import exit_without_cuda, gpt_overrides, parameters, run_trainer, trainer_config  # noqa: E402

from shardwise.bench_result import BenchRun, add_machine_note  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "offload_capacity.json"
MODES = {"none": {"parallel.zero": 0}, "cpu": {"parallel.zero": 2, "parallel.offload": "cpu"},
         "disk": {"parallel.zero": 3, "parallel.offload": "disk"}}
"""Each mode's engine: the layout options our trainer gets."""


def trial(args, mode: str, layers: int, work: Path) -> dict:
    """One run of ``layers`` layers in ``mode`` in this process: ``{"fits": bool, ...}``."""
    import torch

    model = gpt_overrides(layers, args.d_model, args.heads, args.vocab, args.seq_len)
    overrides = {**model, **MODES[mode], "train.precision": "bf16", "train.recompute": args.recompute}
    if mode == "disk":
        overrides["parallel.offload_dir"] = str(Path(args.offload_dir or work) / f"offload-{layers}")
    device = "cpu" if args.smoke else "cuda"
    cfg = trainer_config(work / f"{mode}-{layers}", device, args.warmup + args.steps + 1, args.micro_batch, overrides,
                         args.max_bytes, args.cache_dir)
    try:
        got = run_trainer(cfg, args.warmup)
    except (torch.OutOfMemoryError, MemoryError) as e:
        return {"fits": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    except RuntimeError as e:
        if "out of memory" not in str(e).lower():
            raise
        return {"fits": False, "error": f"RuntimeError: {str(e).splitlines()[0][:300]}"}
    if not math.isfinite(got["final_loss"]):
        return {"fits": False, "error": f"loss {got['final_loss']}"}
    return {"fits": True, **got}


def run_trial(args, mode: str, layers: int, work: Path) -> dict:
    """A trial in a fresh process (``--in-process``: in this one), so one that ran out of memory leaves
    nothing behind; a process killed (host memory) or past ``--trial-timeout`` did not fit."""
    if args.in_process:
        out = trial(args, mode, layers, work)
    else:
        cmd = [sys.executable, __file__, "--trial", mode, str(layers), "--work", str(work), *args.passthrough]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.trial_timeout)
        except subprocess.TimeoutExpired:
            out = {"fits": False, "error": f"did not finish within --trial-timeout {args.trial_timeout} s"}
        else:
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                out = {"fits": False, "error": f"exit status {done.returncode}: {' | '.join(tail)[:500]}"}
            else:
                out = json.loads(lines[-1])
    out = {"layers": layers, "parameters": parameters(gpt_overrides(layers, args.d_model, args.heads, args.vocab,
                                                                    args.seq_len), args.vocab), **out}
    print(f"  {mode:4s} {layers:4d} layers {out['parameters'] / 1e6:10.1f}M params: "
          + (f"trains, {out['tokens_per_s']:.0f} tok/s" if out["fits"] else f"does not fit ({out['error']})"),
          flush=True)
    return out


def largest(args, mode: str, work: Path) -> dict:
    """Doubling, then bisection, over the number of layers (at most ``--max-layers``)."""
    trials, good, bad, layers = [], None, None, 1
    while layers <= args.max_layers:
        t = run_trial(args, mode, layers, work)
        trials.append(t)
        if not t["fits"]:
            bad = layers
            break
        good = t
        layers *= 2
    if bad is None and good is not None and good["layers"] < args.max_layers:  # the cap lies between
        t = run_trial(args, mode, args.max_layers, work)
        trials.append(t)
        if t["fits"]:
            good = t
        else:
            bad = args.max_layers
    lo = good["layers"] if good else 0
    while bad is not None and bad - lo > 1:
        mid = (lo + bad) // 2
        t = run_trial(args, mode, mid, work)
        trials.append(t)
        if t["fits"]:
            good, lo = t, mid
        else:
            bad = mid
    return {"mode": mode, "largest": good, "first_failure_layers": bad, "capped_at_max_layers": bad is None,
            "trials": trials}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--offload", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--recompute", choices=["none", "full", "selective"], default="full")
    ap.add_argument("--max-layers", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per trial (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trial-timeout", type=float, default=1800.0)
    ap.add_argument("--offload-dir", default="", help="where disk offload writes (default: a temporary directory)")
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes")
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--in-process", action="store_true", help="run the trials in this process (no OOM isolation)")
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--smoke", action="store_true", help="tiny, CPU, in-process, up to 2 layers: checks the script")
    ap.add_argument("--trial-processes", action="store_true", help="with --smoke: a process per trial all the same")
    ap.add_argument("--trial", nargs=2, metavar=("MODE", "LAYERS"), help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    add_machine_note(ap)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    args.passthrough = [a for a in raw if a not in ("--in-process",)]
    if args.smoke:
        args.d_model, args.heads, args.vocab, args.seq_len, args.micro_batch = 64, 4, 257, 32, 2
        args.max_layers, args.steps, args.warmup = 2, 1, 1
        args.in_process = args.in_process or not args.trial_processes
        args.max_bytes = min(args.max_bytes, 200_000)
    else:
        exit_without_cuda("bench/bench_offload_capacity.py")
    if args.trial:  # a child: one trial, its result as the last line of stdout
        print(json.dumps(trial(args, args.trial[0], int(args.trial[1]), args.work)), flush=True)
        return
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)

    import torch

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        for mode in args.offload:
            print(f"{mode}:", flush=True)
            results.append(largest(args, mode, Path(tmp)))
    base = next((r["largest"] for r in results if r["mode"] == "none" and r["largest"]), None)
    for r in results:
        if base and r["largest"]:
            r["parameters_over_no_offload"] = r["largest"]["parameters"] / base["parameters"]
            r["tokens_per_s_over_no_offload"] = r["largest"]["tokens_per_s"] / base["tokens_per_s"]
    out = {"benchmark": "offload_capacity", "smoke": args.smoke, "measured": not args.smoke,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
           "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory
           if torch.cuda.is_available() and not args.smoke else None,
           "torch": torch.__version__,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k not in ("trial", "work", "passthrough")},
           "results": results}
    bench_run.write(args.json, out)
    for r in results:
        g = r["largest"]
        print(f"{r['mode']:4s}: " + (f"{g['parameters'] / 1e6:.1f}M parameters ({g['layers']} layers), "
                                     f"{g['tokens_per_s']:.0f} tok/s" if g else "nothing trained")
              + (f", {r['parameters_over_no_offload']:.2f}x the parameters without offload"
                 if "parameters_over_no_offload" in r else ""))


if __name__ == "__main__":
    main()
