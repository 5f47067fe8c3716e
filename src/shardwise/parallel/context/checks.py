"""The config rules of context parallelism, functions of the config alone (no torch)."""

from __future__ import annotations

from shardwise.checks import Unused, choice
from shardwise.config import Config, ConfigError


def check(cfg: Config) -> None:
    """Context parallelism cuts every sequence into cp pieces (2*cp chunks with head-tail balance);
    Ulysses also splits the heads (of each tensor-parallel rank) over cp."""
    p, m = cfg.parallel, cfg.model
    choice("parallel.cp_algorithm", p.cp_algorithm)
    choice("parallel.cp_balance", p.cp_balance)
    if p.cp == 1:
        return
    if cfg.train.objective == "classify":
        raise ConfigError(f"parallel.cp={p.cp} with train.objective='classify': the classifier reads the [CLS] "
                          "token, which one context-parallel rank holds, and its label is per sequence; use "
                          "parallel.cp=1")
    chunks = 2 * p.cp if p.cp_balance == "headtail" else p.cp
    unit = chunks * (p.tp if p.sequence_parallel else 1)
    s = cfg.data.seq_len
    if s % unit:
        what = f"{chunks} chunks (parallel.cp={p.cp}, parallel.cp_balance={p.cp_balance!r})"
        if p.sequence_parallel:
            what += f" of a multiple of parallel.tp={p.tp} (sequence parallel)"
        near = [v for v in (s // unit * unit, (s // unit + 1) * unit) if v > 0]
        raise ConfigError(f"data.seq_len={s} does not divide into {what}; use a multiple of {unit}, e.g. "
                          f"{' or '.join(map(str, near))}")
    if p.cp_algorithm == "ring" and cfg.run.device == "cuda" and p.backend == "gloo":
        raise ConfigError("parallel.cp_algorithm='ring' with run.device='cuda' and parallel.backend='gloo': the "
                          "ring passes K/V blocks point to point, and gloo's point-to-point takes CPU tensors only; "
                          "use parallel.backend='nccl' (or 'auto') or run.device='cpu'")
    if p.cp_algorithm == "ring":
        for key, why in (("sliding_window", "a sliding window"), ("attn_softcap", "soft-capped scores"),
                         ("kv_lora_rank", "latent attention's values narrower than its keys")):
            if getattr(m, key, 0):
                raise ConfigError(f"parallel.cp_algorithm='ring' with model.{key}={getattr(m, key)}: the ring's "
                                  f"blocks are plain attention of equal key and value widths, without {why}; use "
                                  "'allgather' or 'ulysses'")
    if p.cp_algorithm == "ulysses":
        heads, kv = m.n_heads // p.tp, max(m.n_kv_heads // p.tp, 1)
        if heads % p.cp:
            raise ConfigError(f"parallel.cp_algorithm='ulysses' splits the {heads} heads of each tensor-parallel "
                              f"rank over parallel.cp={p.cp}; use a cp dividing {heads}, or 'ring'")
        if kv % p.cp and p.cp % kv:
            raise ConfigError(f"parallel.cp_algorithm='ulysses': {kv} key/value heads per tensor-parallel rank "
                              f"neither divide by nor divide parallel.cp={p.cp}; use 'ring'")


def unused(cfg: Config) -> list[Unused]:
    cp = cfg.parallel.cp > 1
    return [
        Unused("parallel.cp_algorithm", cp, "picks context-parallel attention, but parallel.cp=1; set "
               "parallel.cp > 1 or remove it"),
        Unused("parallel.cp_balance", cp, "splits sequences over context-parallel ranks, but parallel.cp=1; set "
               "parallel.cp > 1 or remove it"),
    ]
