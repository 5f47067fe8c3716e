"""Shared by the single-GPU benchmarks (bench_mfu.py, bench_offload_capacity.py): run *our trainer* --
``shardwise.train.loop.train``, the code ``shardwise train`` runs in each worker -- on one device in this
process, and read what it measured from its ``metrics.jsonl`` (tokens/s and MFU per optimizer step,
timed by the trainer itself).

The model is a GPT-2-flavour ``shardwise.model.Transformer`` of a given shape; the data the built-in
corpus (byte tokenizer) cut into windows of ``seq_len`` tokens, whatever ``vocab_size`` the model
has (the ids stay below 257, which changes no FLOP and no byte of the run).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO / "src"))

NO_CUDA = ("{script} measures one GPU, but torch.cuda.is_available() is False (torch {version}); run it on a "
           "machine with a CUDA GPU, or pass --smoke for the tiny CPU run that only checks the script works")


def exit_without_cuda(script: str) -> None:
    """The clear message and exit status 2 when there is no GPU to measure."""
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA.format(script=script, version=torch.__version__), file=sys.stderr)
        raise SystemExit(2)


def gpt_overrides(n_layers: int, d_model: int, n_heads: int, vocab_size: int, seq_len: int) -> dict:
    return {"model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": n_layers, "model.d_model": d_model,
            "model.n_heads": n_heads, "model.vocab_size": vocab_size, "model.max_seq_len": seq_len,
            "data.seq_len": seq_len}


def trainer_config(run_dir: Path, device: str, steps: int, micro_batch: int, overrides: dict, max_bytes: int,
                   cache_dir: str = ""):
    """The resolved config of a one-device run of ``steps`` steps without accumulation, evaluation or
    checkpoints in the timed steps."""
    from shardwise.config import Config
    from shardwise.launch import prepare_run

    base = {"data.source": "stdlib", "data.max_bytes": max_bytes, "data.cache_dir": cache_dir,
            "train.steps": steps, "train.global_batch": micro_batch, "train.micro_batch": micro_batch,
            "train.warmup_steps": 1, "train.lr": 3e-4, "train.eval_every": 0, "train.eval_batches": 1,
            "parallel.nproc": 1, "run.device": device, "ckpt.every": 0, "run.dir": str(run_dir),
            "run.progress": "false", "run.tensorboard": "false"}
    merged = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in {**base, **overrides}.items()}
    cfg, _ = prepare_run(Config.load(overrides=merged))
    return cfg


def run_trainer(cfg, warmup: int) -> dict:
    """Train ``cfg`` with our trainer in this process; the medians of what it logged after ``warmup`` steps.

    The run stops one step before ``train.steps`` (``stop_after``), so the final checkpoint, which
    is not part of what is timed, is not written."""
    import gc

    import torch

    from shardwise.train.loop import train

    run_dir = Path(cfg.run.dir)
    result = train(cfg, run_dir, stop_after=cfg.train.steps - 1)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r][warmup:]
    if not steps:
        raise RuntimeError(f"no timed steps after {warmup} warm-up steps in {run_dir / 'metrics.jsonl'}")
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
           "mfu": statistics.median(r["mfu"] for r in steps),
           "step_time_s": statistics.median(r["step_time_s"] for r in steps),
           "timed_steps": len(steps), "final_loss": result.losses[-1]}
    del result
    gc.collect()
    if torch.cuda.is_available():
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def parameters(overrides: dict, vocab_size: int) -> int:
    """The model's parameter count, from a meta-device build (no memory)."""
    import torch

    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer

    merged = {k: str(v) for k, v in overrides.items()}
    cfg = resolve(Config.load(overrides=merged), world_size=1, tokenizer_vocab=257)
    with torch.device("meta"):
        return Transformer(cfg.model).num_parameters()
