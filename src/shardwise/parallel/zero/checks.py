"""The config rules of ZeRO (stages, offload, ZeRO++'s quantized collectives and hpZ, its overlaps) and of the
gradient reduction's dtype, functions of the config alone (no torch)."""

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
    choice("parallel.grad_reduce_dtype", p.grad_reduce_dtype)
    if p.grad_reduce_dtype != "auto" and p.zero_quant_grads:
        raise ConfigError(f"parallel.grad_reduce_dtype={p.grad_reduce_dtype!r} and parallel.zero_quant_grads=true "
                          "both set how gradients travel (int8 blocks); keep one: parallel.grad_reduce_dtype='auto'")
    if p.grad_reduce_dtype != "auto" and cfg.comm.compression != "none":
        raise ConfigError(f"parallel.grad_reduce_dtype={p.grad_reduce_dtype!r} and comm.compression="
                          f"{cfg.comm.compression!r} both set how gradients travel; keep one: "
                          "parallel.grad_reduce_dtype='auto' or comm.compression='none'")
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
        Unused("parallel.zero_overlap_param_gather", p.zero in (1, 2), f"overlaps ZeRO-1/2's parameter all-gather "
               f"with the next forward, but parallel.zero={p.zero}; set parallel.zero to 1 or 2 or remove it"),
        Unused("parallel.zero_overlap_grad_reduce", p.zero in (1, 2), f"overlaps ZeRO-1/2's gradient reduce-scatter "
               f"with backward, but parallel.zero={p.zero}; set parallel.zero to 1 or 2 or remove it"),
        Unused("parallel.grad_reduce_dtype", not cfg.ps.servers, f"sets how data-parallel gradients travel, but "
               f"ps.servers={cfg.ps.servers} sends them to parameter servers; remove it"),
        Unused("parallel.offload_dir", p.offload == "disk", f"is where parallel.offload='disk' writes, but "
               f"parallel.offload={p.offload!r}; set parallel.offload='disk' or remove it"),
    ]
