"""The config rules of the gradient all-reduce's algorithms and compression, functions of the config alone
(no torch)."""

from __future__ import annotations

from shardwise.checks import Unused, choice, positive
from shardwise.config import Config, ConfigError


def check(cfg: Config) -> None:
    c = cfg.comm
    choice("comm.algorithm", c.algorithm)
    choice("comm.compression", c.compression)
    if not 0 < c.topk_ratio <= 1:
        raise ConfigError(f"comm.topk_ratio={c.topk_ratio} is not valid; use a fraction in (0, 1]")
    positive("comm.node_size", c.node_size, allow_zero=True)
    positive("comm.timeout_s", c.timeout_s, allow_zero=True)
    p = cfg.parallel
    if cfg.run.device == "cuda" and p.backend == "gloo" and not p.zero and (p.dp or 1) * p.cp > 1:
        if c.algorithm != "native":
            raise ConfigError(f"comm.algorithm={c.algorithm!r} with run.device='cuda' and parallel.backend='gloo': "
                              "our all-reduce algorithms send CUDA tensors point to point, which gloo takes on the "
                              "CPU only; use comm.algorithm='native' or parallel.backend='nccl' (or 'auto')")
        if c.compression in ("int8", "topk"):
            raise ConfigError(f"comm.compression={c.compression!r} with run.device='cuda' and parallel.backend="
                              "'gloo': it all-gathers CUDA tensors, and gloo has only all-reduce and broadcast for "
                              "them; use parallel.backend='nccl' (or 'auto'), or 'none', 'fp16' or 'bf16'")


def unused(cfg: Config) -> list[Unused]:
    """In order: a cause (comm.compression under ZeRO) is named before its consequences (comm.topk_ratio)."""
    p, c = cfg.parallel, cfg.comm
    zero = f"ZeRO (parallel.zero={p.zero})"
    own = "shardwise's own collective algorithms"
    return [
        Unused("comm.algorithm", not p.zero, f"applies to the data-parallel all-reduce; {zero} reduces with the "
               "backend's reduce-scatter and all-gather; use comm.algorithm='native'"),
        Unused("comm.compression", not p.zero, f"applies to the data-parallel all-reduce; {zero} reduces with the "
               "backend's reduce-scatter; use parallel.zero_quant_grads for compressed ZeRO gradients"),
        Unused("comm.timeout_s", not p.zero, f"bounds {own}; {zero} runs the backend's collectives, which "
               "parallel.timeout_s bounds; set parallel.timeout_s instead"),
        Unused("comm.algorithm", c.compression not in ("int8", "topk") or c.algorithm == "ring",
               f"is an all-reduce algorithm, but comm.compression={c.compression!r} sends an all-to-all and an "
               "all-gather instead; use comm.algorithm='native' (the backend's) or 'ring' (ours)"),
        Unused("comm.timeout_s", c.algorithm != "native", f"bounds {own}, but comm.algorithm='native' runs the "
               "backend's, which parallel.timeout_s bounds; set parallel.timeout_s instead, or another comm.algorithm"),
        Unused("comm.topk_ratio", c.compression == "topk", f"applies to comm.compression='topk', but "
               f"comm.compression={c.compression!r}; set comm.compression='topk' or remove it"),
        Unused("comm.node_size", c.algorithm in ("hierarchical", "torus", "auto"), f"shapes the 'hierarchical' and "
               f"'torus' all-reduce (and what 'auto' picks), but comm.algorithm={c.algorithm!r}; remove it"),
    ]
