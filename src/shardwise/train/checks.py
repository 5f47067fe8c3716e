"""The config rules of the training loop (hyper-parameters, precision, recomputation), checkpoints and
restarts, functions of the config alone (no torch)."""

from __future__ import annotations

from shardwise.checks import Unused, choice, positive
from shardwise.config import Config, ConfigError
from shardwise.train.faults import parse_faults


def check(cfg: Config) -> None:
    t = cfg.train
    positive("train.steps", t.steps)
    positive("train.lr", t.lr)
    positive("train.min_lr", t.min_lr, allow_zero=True)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} exceeds train.lr={t.lr}")
    positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    positive("train.weight_decay", t.weight_decay, allow_zero=True)
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be in [0, 1)")
    positive("train.eps", t.eps)
    positive("train.grad_clip", t.grad_clip, allow_zero=True)
    positive("train.skip_grad_norm_above", t.skip_grad_norm_above, allow_zero=True)
    positive("train.max_skipped_steps", t.max_skipped_steps, allow_zero=True)
    choice("train.precision", t.precision)
    positive("train.fp16_init_scale", t.fp16_init_scale)
    positive("train.fp16_growth_interval", t.fp16_growth_interval)
    choice("train.recompute", t.recompute)
    positive("train.recompute_every", t.recompute_every)
    positive("train.eval_every", t.eval_every, allow_zero=True)
    positive("train.eval_batches", t.eval_batches)
    positive("train.peak_flops", t.peak_flops, allow_zero=True)


def check_run(cfg: Config) -> None:
    """Checkpoints, restarts and injected faults (run.fault, for tests: existing ranks and steps, one fault
    per attempt)."""
    r = cfg.run
    positive("ckpt.every", cfg.ckpt.every, allow_zero=True)
    positive("ckpt.keep", cfg.ckpt.keep)
    positive("run.max_restarts", r.max_restarts, allow_zero=True)
    if cfg.ckpt.async_ and cfg.ps.servers:
        raise ConfigError(f"ckpt.async=true with ps.servers={cfg.ps.servers}: the parameter server's checkpoints "
                          "are written synchronously (not composed yet); use ckpt.async=false")
    faults = parse_faults(r.fault, cfg.parallel.nproc * cfg.parallel.nnodes, cfg.train.steps)
    if len(faults) > r.max_restarts + 1:
        raise ConfigError(f"run.fault={r.fault!r} injects {len(faults)} failures, one per attempt, but "
                          f"run.max_restarts={r.max_restarts} allows {r.max_restarts + 1} attempts; raise it")


def unused(cfg: Config) -> list[Unused]:
    t = cfg.train
    scaler = (f"configures the fp16 loss scaler, but train.precision={t.precision!r} has none; set "
              "train.precision='fp16' or remove it")
    return [
        Unused("train.recompute_every", t.recompute == "full", f"applies to train.recompute='full', but "
               f"train.recompute={t.recompute!r}; set train.recompute='full' or remove it"),
        Unused("train.fp16_init_scale", t.precision == "fp16", scaler),
        Unused("train.fp16_growth_interval", t.precision == "fp16", scaler),
    ]
