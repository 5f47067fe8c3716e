"""Model FLOPs per token and utilisation (MFU).

FLOPs per token for training (forward + backward) follow PaLM (Chowdhery et al. 2022,
Appendix B): 6·N + 12·L·H·Q·T, where N is the number of non-embedding parameters, L layers,
H heads, Q head size and T the sequence length — the second term is attention's score and
value matmuls. The output projection onto the vocabulary (V·d multiply-adds per token, the
"de-embedding" of Kaplan et al. 2020, Table 1) is a matmul too and is added to N; the token
lookup is not. Recomputation is not counted (that is *model* FLOPs utilisation, not hardware).
"""

from __future__ import annotations

import time

import torch

from shardwise.config import ModelConfig

# Dense peak FLOP/s per dtype from the vendors' data sheets (no 2:4 sparsity).
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "V100": {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12},
}


def training_flops_per_token(model_cfg: ModelConfig, non_embedding_params: int, seq_len: int) -> float:
    """6·(N + V·d) + 12·L·d·T (PaLM Appendix B with the vocabulary projection; H·Q = d_model)."""
    head = model_cfg.vocab_size * model_cfg.d_model
    return 6.0 * (non_embedding_params + head) + 12.0 * model_cfg.n_layers * model_cfg.d_model * seq_len


def peak_flops(device: torch.device, precision: str, configured: float = 0.0) -> float:
    """Peak FLOP/s of one device: the configured value, the GPU table, or a measured CPU matmul."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name:
                return table.get(precision, table["fp32"])
        return 0.0
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
