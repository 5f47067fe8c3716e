"""The config rules of tensor and sequence parallelism, functions of the config alone (no torch)."""

from __future__ import annotations

from shardwise.checks import Unused, divisors
from shardwise.config import Config, ConfigError, ModelConfig


def check_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """Raise ConfigError naming the field unless model ``m`` splits over ``tp`` ranks: heads, key/value heads
    (split when tp <= n_kv_heads, replicated when tp > n_kv_heads) and the MLP width."""
    if m.n_heads % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide model.n_heads={m.n_heads}; use {divisors(m.n_heads)}")
    kv = m.n_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            f"parallel.tp={tp} and model.n_kv_heads={kv}: one must divide the other "
            f"(kv heads split when tp <= n_kv_heads, replicated when tp > n_kv_heads)"
        )
    if m.d_ff % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide model.d_ff={m.d_ff}; use {divisors(m.d_ff)}")
    if getattr(m, "qk_norm", False) and getattr(m, "qk_norm_scope", "head") == "projection" and tp > kv:
        raise ConfigError(f"parallel.tp={tp} with model.qk_norm_scope='projection' and model.n_kv_heads={kv}: the "
                          "norm over the whole key projection would count key heads replicated over the ranks more "
                          f"than once; use parallel.tp <= {kv}")


def check(cfg: Config) -> None:
    """Tensor parallelism splits heads, the MLP width and the vocabulary (:mod:`.plan` says how); sequence
    parallelism also splits the sequence over the same ranks."""
    p, m = cfg.parallel, cfg.model
    if p.tp > 1:
        check_tensor_parallel(m, p.tp)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true splits the sequence over the tensor-parallel ranks, "
                          "but parallel.tp=1; set parallel.tp > 1 or parallel.sequence_parallel=false")
    if p.sequence_parallel and cfg.data.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel=true needs data.seq_len={cfg.data.seq_len} divisible by "
                          f"parallel.tp={p.tp}; use a multiple of {p.tp}")
    if p.tp_comm_overlap and p.tp > 1 and cfg.train.compile:
        raise ConfigError("parallel.tp_comm_overlap=true with train.compile=true: the decomposed collectives hand "
                          "projections a stand-in input that torch.compile would trace through; set one of them false")
    if p.tp_comm_overlap and p.tp > 1 and p.pp > 1 and p.pp_schedule == "zb-h1":
        raise ConfigError("parallel.tp_comm_overlap=true with parallel.pp_schedule='zb-h1': the decomposed projections "
                          "compute their weight gradients in backward, which zb-h1 defers to its W passes; use another "
                          "schedule or parallel.tp_comm_overlap=false")
    if p.sequence_parallel and cfg.train.objective == "classify":
        raise ConfigError("parallel.sequence_parallel=true with train.objective='classify': the classifier reads the "
                          "[CLS] token, which only the first tensor-parallel rank's piece of the sequence holds; "
                          "use parallel.sequence_parallel=false")


def unused(cfg: Config) -> list[Unused]:
    p = cfg.parallel
    return [Unused("parallel.tp_comm_overlap", p.tp > 1, f"overlaps tensor-parallel communication with its matmuls, "
                   f"but parallel.tp={p.tp}; set parallel.tp > 1 or remove it")]
