"""``shardwise generate RUN_DIR``: rebuild a run's model from its config and newest valid checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.config import Config
from shardwise.config_resolve import resolve


def load_trained_model(run_dir: Path, checkpoint: Path | None = None):
    """The model of ``run_dir`` with the weights of ``checkpoint`` (default: the newest valid one)."""
    from shardwise.model import Transformer
    from shardwise.train.checkpoint import CheckpointError, latest_valid_checkpoint, verify_checkpoint
    from shardwise.train.state import open_checkpoint, resume_mismatch

    run_dir = Path(run_dir)
    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.toml)")
    cfg = resolve(Config.load(config_file))  # the saved layout; only the model section is used here
    path = checkpoint or latest_valid_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise FileNotFoundError(f"{run_dir} has no valid checkpoint under checkpoints/")
    verify_checkpoint(path)
    problem = resume_mismatch(path, cfg)
    if problem is not None:  # one line naming the tensor, rather than load_state_dict's list
        raise CheckpointError(f"{problem}; {config_file} does not describe the model of this checkpoint")
    model = Transformer(cfg.model)
    model.load_state_dict(dict(open_checkpoint(path).model_state()))
    return model, cfg


def generate_from_run(run_dir: Path, prompt: str | list[str], max_new_tokens: int = 200, temperature: float = 0.8,
                      top_k: int | None = 50, seed: int = 0, checkpoint: Path | None = None,
                      use_cache: bool = True, timing: dict | None = None) -> str | list[str]:
    """The text generated after ``prompt`` (or after each of a list of prompts, as one batch). ``timing``,
    when given, receives ``tokens`` (generated, all rows), ``seconds`` and ``tokens_per_s``."""
    import time

    from shardwise.data import tokenizer_from_run
    from shardwise.model import generate_batch

    model, _cfg = load_trained_model(run_dir, checkpoint)
    tokenizer = tokenizer_from_run(run_dir)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    ids = [tokenizer.encode(p) for p in prompts]
    t0 = time.perf_counter()
    with torch.inference_mode():
        new_ids = generate_batch(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                                 use_cache=use_cache)
    if timing is not None:
        seconds = time.perf_counter() - t0
        timing.update(tokens=max_new_tokens * len(ids), seconds=seconds,
                      tokens_per_s=max_new_tokens * len(ids) / seconds if seconds else 0.0)
    texts = [tokenizer.decode(n) for n in new_ids]
    return texts[0] if isinstance(prompt, str) else texts
