"""Failures at scale: how often the job is interrupted, what a checkpoint and a restart cost, the interval
between checkpoints that maximises goodput, and the ``ckpt.every`` it means.

* Failure rate: a per-GPU mean time between failures, exponential failures (Young 1974). The default comes
  from the Llama 3 report (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.4): 419 unexpected
  interruptions in a 54-day snapshot on 16,384 H100s, i.e. 54 x 24 x 16384 / 419 = 50,677 GPU-hours per
  interruption; a job on N GPUs fails every ``mtbf / N`` hours.
* Checkpoint write and restart: the trainer's own writer and reader (:func:`shardwise.train.checkpoint.
  save_checkpoint`: safetensors, fsync, SHA-256 manifest; :func:`~shardwise.train.checkpoint.load_checkpoint`:
  verify and read), timed per GB on this machine (:func:`measure_checkpoint_rates`); at scale every writing
  rank writes its share at that rate, unless the file system's aggregate bandwidth is the slower. What a rank
  writes: fp32 weights and Adam's two moments of its pieces (12 bytes per parameter; one data-parallel
  replica writes, or every ZeRO rank its shard). A restart costs ``restart_s`` (rescheduling, start-up) plus
  reading the checkpoint.
* Goodput: Daly 2006 ("A higher order estimate of the optimum checkpoint interval for restart dumps", Future
  Generation Computer Systems 22(3), eq. 13): work ``tau`` between checkpoints of ``delta`` seconds, restart
  ``R``, mean time between failures ``M`` take expected wall time ``M e^(R/M) (e^((tau+delta)/M) - 1)`` per
  ``tau`` of work, failures during checkpoints and restarts included; goodput is the ratio. The interval
  that maximises it is found numerically and set beside Young's first-order ``sqrt(2 delta M)`` (Young 1974,
  "A first order approximation to the optimum checkpoint interval", CACM 17(9)) and Daly's higher-order
  estimate (eq. 37).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 * 16384 / 419
"""Per-GPU mean time between unexpected interruptions in the Llama 3 pre-training snapshot, hours."""
STATE_BYTES_PER_PARAM = 12
"""fp32 weights and Adam's two moments, as the trainer's layout-free checkpoints hold them."""


def measure_checkpoint_rates(nbytes: int = 128 << 20, directory: str | None = None) -> tuple[float, float]:
    """``(write, read)`` seconds per GB of the trainer's checkpoint writer and reader on this machine."""
    import torch

    from shardwise.train.checkpoint import load_checkpoint, save_checkpoint

    n = nbytes // 4 // 8
    tensors = {f"w{i}": torch.randn(n) for i in range(8)}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        path = save_checkpoint(root, 1, {"model": tensors}, {"measure": True}, keep=1)
        t1 = time.perf_counter()
        load_checkpoint(path)
        t2 = time.perf_counter()
    gb = 8 * n * 4 / 1e9
    return (t1 - t0) / gb, (t2 - t1) / gb


def goodput(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Useful fraction of wall time with checkpoints every ``tau`` seconds of work (Daly 2006, eq. 13)."""
    if tau <= 0:
        return 0.0
    x = (tau + delta) / mtbf
    if x > 700:  # the job essentially never finishes an interval
        return 0.0
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1(x))


def best_interval(delta: float, restart: float, mtbf: float) -> float:
    """The ``tau`` maximising :func:`goodput` (golden-section search on a log scale; goodput is unimodal)."""
    lo, hi = math.log(max(delta, 1e-3) * 1e-3), math.log(mtbf * 10)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if goodput(math.exp(a), delta, restart, mtbf) < goodput(math.exp(b), delta, restart, mtbf):
            lo = a
        else:
            hi = b
    return math.exp((lo + hi) / 2)


def young(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


def daly(delta: float, mtbf: float) -> float:
    """Daly 2006 eq. 37: sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta, for delta < 2M."""
    if delta >= 2 * mtbf:
        return mtbf
    r = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - delta


def failure_report(params: float, world: int, writers: int, step_time_s: float, write_s_per_gb: float,
                   read_s_per_gb: float, storage_write_bw: float, storage_read_bw: float, restart_s: float,
                   mtbf_gpu_hours: float = LLAMA3_GPU_HOURS_PER_FAILURE) -> dict:
    """Expected goodput and the checkpoint interval for a job of ``world`` GPUs whose checkpoint holds
    ``params`` parameters written by ``writers`` ranks in parallel; every input and intermediate returned."""
    total = STATE_BYTES_PER_PARAM * params
    per_writer = total / max(writers, 1)
    write = max(per_writer / 1e9 * write_s_per_gb, total / storage_write_bw)
    read = max(per_writer / 1e9 * read_s_per_gb, total / storage_read_bw)
    restart = restart_s + read
    mtbf = mtbf_gpu_hours * 3600 / world
    tau = best_interval(write, restart, mtbf)
    every = max(1, round(tau / step_time_s)) if step_time_s > 0 else 1
    return {"mtbf_per_gpu_h": mtbf_gpu_hours, "job_mtbf_h": mtbf / 3600, "checkpoint_bytes": total,
            "writers": writers, "write_s_per_gb_measured": write_s_per_gb, "read_s_per_gb_measured": read_s_per_gb,
            "checkpoint_write_s": write, "restart_s": restart, "interval_s": tau, "young_s": young(write, mtbf),
            "daly_s": daly(write, mtbf), "ckpt_every": every,
            "goodput": goodput(every * step_time_s, write, restart, mtbf)}
