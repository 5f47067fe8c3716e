"""The config rules of ZeRO (stages, offload, ZeRO++'s quantized collectives and hpZ), functions of the config
alone (no torch)."""

from __future__ import annotations

from shardwise.checks import Unused, choice, divisors, positive
from shardwise.config import CHOICES, Config, ConfigError


def check(cfg: Config) -> None:
    p = cfg.parallel
    if p.zero not in CHOICES["parallel.zero"]:
        raise ConfigError(f"parallel.zero={p.zero}: use 0 (off), 1, 2 or 3")
    if p.offload not in CHOICES["parallel.offload"]:
        raise ConfigError(f"parallel.offload={p.offload!r}: use 'none', 'cpu' or 'disk'")
    if p.offload != "none" and p.zero == 0:
        raise ConfigError(f"parallel.offload={p.offload!r} needs ZeRO; set parallel.zero to 1, 2 or 3")
    positive("parallel.zero_unit", p.zero_unit)
    choice("parallel.zero_param_dtype", p.zero_param_dtype)
    if p.zero_quant_weights and p.zero != 3:
        raise ConfigError(f"parallel.zero_quant_weights=true quantizes ZeRO-3's parameter gathers, "
                          f"but parallel.zero={p.zero}; set parallel.zero=3")
    if p.zero_quant_grads and p.zero == 0:
        raise ConfigError("parallel.zero_quant_grads=true needs ZeRO; set parallel.zero to 1, 2 or 3")
    positive("parallel.zero_hpz", p.zero_hpz)
    if p.zero_hpz != 1 and p.zero != 3:
        raise ConfigError(f"parallel.zero_hpz={p.zero_hpz} partitions ZeRO-3's parameters within a node, "
                          f"but parallel.zero={p.zero}; set parallel.zero=3 or parallel.zero_hpz=1")
    if (p.dp * p.cp) % p.zero_hpz:  # ZeRO shards over dp x cp; hpZ's groups are consecutive ranks of it
        raise ConfigError(f"parallel.zero_hpz={p.zero_hpz} does not divide parallel.dp*cp={p.dp * p.cp}; "
                          f"use one of {divisors(p.dp * p.cp)}")
    if p.zero and cfg.run.device == "cuda" and p.backend == "gloo":
        raise ConfigError(f"parallel.zero={p.zero} with run.device='cuda' and parallel.backend='gloo': ZeRO "
                          "reduce-scatters gradients and all-gathers parameters on the GPU, and gloo has only "
                          "all-reduce and broadcast for CUDA tensors; use parallel.backend='nccl' (or 'auto') or "
                          "run.device='cpu'")


def check_param_dtype(cfg: Config) -> None:
    """bf16 flat parameters beside fp32 masters need ZeRO and bf16 training (checked after the train section)."""
    p = cfg.parallel
    if p.zero_param_dtype != "fp32" and (p.zero == 0 or cfg.train.precision != "bf16"):
        raise ConfigError(f"parallel.zero_param_dtype={p.zero_param_dtype!r} keeps ZeRO's flat parameters in bf16 "
                          f"beside fp32 masters; it needs parallel.zero >= 1 (is {p.zero}) and train.precision='bf16' "
                          f"(is {cfg.train.precision!r})")


def unused(cfg: Config) -> list[Unused]:
    p = cfg.parallel
    return [
        Unused("parallel.zero_unit", p.zero == 3, f"groups ZeRO-3's parameter gathers, but parallel.zero={p.zero}; "
               "set parallel.zero=3 or remove it"),
        Unused("parallel.bucket_mb", p.zero != 3, "sizes gradient buckets, but ZeRO-3 (parallel.zero=3) gathers and "
               "reduces whole units; set parallel.zero_unit (blocks per unit) instead"),
        Unused("parallel.offload_dir", p.offload == "disk", f"is where parallel.offload='disk' writes, but "
               f"parallel.offload={p.offload!r}; set parallel.offload='disk' or remove it"),
    ]
