"""Model FLOPs per token and utilisation (MFU) for the trainer.

The formula and the GPU peak table live in the planner (``shardwise.plan.flops`` and
``shardwise.plan.hardware``), so that the trainer's ``mfu`` and the plan's prediction use the
same numbers: FLOPs per token for training (forward + backward) follow PaLM (Chowdhery et al.
2022, Appendix B): 6·N + 12·L·H·Q·T, where N counts the non-embedding matmul parameters plus the
output projection onto the vocabulary (Kaplan et al. 2020, Table 1), counted once whether or not
it is tied to the token embedding. Recomputation is not counted (model, not hardware, FLOPs).
"""

from __future__ import annotations

import time

import torch

from shardwise.config import ModelConfig
from shardwise.plan.flops import flops_per_token
from shardwise.plan.hardware import GPU_PEAK_FLOPS, peak_flops_for_device_name
from shardwise.plan.spec import ModelSpec, architecture_of

__all__ = ["GPU_PEAK_FLOPS", "training_flops_per_token", "peak_flops", "measure_cpu_matmul_flops"]


def training_flops_per_token(model_cfg: ModelConfig, seq_len: int | None = None) -> float:
    """6·N + 12·L·d·T for a resolved ``ModelConfig``, N the parameters one token uses (with experts: its
    top-k) (see :func:`shardwise.plan.flops.flops_per_token`);
    the planner counts the parameters exactly from the config (an untied head once, as the vocabulary
    projection). ``seq_len`` defaults to ``model_cfg.max_seq_len``."""
    spec = ModelSpec(
        flavor=model_cfg.flavor, n_layers=model_cfg.n_layers, d_model=model_cfg.d_model, n_heads=model_cfg.n_heads,
        n_kv_heads=model_cfg.n_kv_heads or model_cfg.n_heads, d_ff=model_cfg.d_ff, vocab_size=model_cfg.vocab_size,
        max_seq_len=model_cfg.max_seq_len, tie_embeddings=bool(model_cfg.tie_embeddings),
        n_experts=model_cfg.n_experts or 0, moe_top_k=model_cfg.moe_top_k, moe_every=model_cfg.moe_every,
        moe_shared=model_cfg.moe_shared, moe_d_ff=model_cfg.moe_d_ff, qk_norm=model_cfg.qk_norm,
        **architecture_of(model_cfg),
    )
    return flops_per_token(spec, seq_len if seq_len is not None else model_cfg.max_seq_len)


def peak_flops(device: torch.device, precision: str, configured: float = 0.0) -> float:
    """Peak FLOP/s of one device: the configured value, the GPU table, or a measured CPU matmul."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        return peak_flops_for_device_name(torch.cuda.get_device_name(device), precision)
    return measure_cpu_matmul_flops(torch.bfloat16 if precision == "bf16" else torch.float32)


def measure_cpu_matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 6) -> float:
    """The best FLOP/s of an n×n matmul on this process's threads: a practical CPU peak.

    Best-of-``repeats`` after a warm-up, so a busy neighbour process lowers the estimate less."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best
