"""``shardwise generate RUN_DIR``: rebuild a run's model from its config and newest valid checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.config import Config


def load_trained_model(run_dir: Path, checkpoint: Path | None = None):
    """The model of ``run_dir`` with the weights of ``checkpoint`` (default: the newest valid one)."""
    from shardwise.model import Transformer
    from shardwise.train.checkpoint import latest_valid_checkpoint, verify_checkpoint
    from shardwise.train.state import open_checkpoint

    run_dir = Path(run_dir)
    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.toml)")
    cfg = Config.load(config_file).resolve()  # the saved layout; only the model section is used here
    path = checkpoint or latest_valid_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise FileNotFoundError(f"{run_dir} has no valid checkpoint under checkpoints/")
    verify_checkpoint(path)
    model = Transformer(cfg.model)
    model.load_state_dict(dict(open_checkpoint(path).model_state()))
    return model, cfg


def generate_from_run(run_dir: Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                      top_k: int | None = 50, seed: int = 0, checkpoint: Path | None = None) -> str:
    from shardwise.data import tokenizer_from_run
    from shardwise.model import generate

    model, _cfg = load_trained_model(run_dir, checkpoint)
    tokenizer = tokenizer_from_run(run_dir)
    prompt_ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        new_ids = generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return tokenizer.decode(new_ids)
