"""FLOPs per token and per iteration: the single source for the planner and the trainer's MFU.

Conventions (a multiply-add is 2 FLOPs; backward costs twice the forward):
  * **6·N·D** — Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1: training
    costs about 6 FLOPs per parameter per token.
  * **Model FLOPs per token** (what MFU counts; Chowdhery et al. 2022, "PaLM", Appendix B):
    6·N + 12·L·H·Q·T with N the matmul parameters (non-embedding plus the output projection onto
    the vocabulary, Kaplan's "de-embedding"; MoE: active parameters only), L layers, H·Q = d_model,
    T the sequence length — the second term is attention's score and value matmuls.
  * **Hardware FLOPs** add what recomputation repeats: full recomputation repeats the forward
    (8·N' + 16·L·d·T), selective recomputation repeats attention's score and value matmuls
    (Korthikanti et al. 2022, §5: + 4·L·d·T per token).
  * **Megatron per iteration** — Narayanan et al. 2021, §5.1, eq. (3):
    F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full recomputation (4 passes over the layers);
    without recomputation the same derivation gives 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
"""

from __future__ import annotations

from shardwise.plan.params import count_params
from shardwise.plan.spec import ModelSpec

CONVENTIONS = ("model", "hardware")


def matmul_params(m: ModelSpec) -> int:
    """Parameters that take part in a matmul for one token: active non-embedding + the vocabulary projection."""
    c = count_params(m)
    return c.active - c.embedding - c.position - c.head + m.vocab_size * m.d_model


def attention_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """12·L·d·T: attention scores and weighted values, forward and backward (PaLM Appendix B), with the heads'
    own widths (``6·L·T·H·(d_qk + d_v)``: head_dim != d / H, latent attention's narrower values) and, in a
    sliding block, the keys within its window (``min(T, window)``)."""
    v = m.v_head_dim or m.head_dim if m.kv_lora_rank else m.head_dim
    keys = sum(min(seq_len, m.sliding_window) if m.is_sliding_block(i) else seq_len for i in range(m.n_layers))
    return 6.0 * m.n_heads * (m.head_dim + v) * keys


def flops_per_token(m: ModelSpec, seq_len: int, recompute: str = "none", convention: str = "model") -> float:
    """Training FLOPs per token. ``convention="model"`` ignores recomputation (MFU);
    ``"hardware"`` counts the recomputed forward work (HFU)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r}; use one of {CONVENTIONS}")
    n = matmul_params(m)
    attn = attention_flops_per_token(m, seq_len)
    base = 6.0 * n + attn
    if convention == "model" or recompute == "none":
        return base
    if recompute == "selective":
        return base + attn / 3.0
    if recompute == "full":
        # the recomputed forward covers the blocks, not the output projection
        head = m.vocab_size * m.d_model
        return base + (2.0 * (n - head) + attn / 3.0)
    raise ValueError(f"recompute={recompute!r}; use none, selective or full")


def six_nd(n_params: float, tokens: float) -> float:
    """6·N·D total training FLOPs (Kaplan et al. 2020 §2.1)."""
    return 6.0 * n_params * tokens


def megatron_flops_per_iteration(batch: int, seq_len: int, n_layers: int, d_model: int, vocab_size: int,
                                 recompute: bool = True) -> float:
    """Narayanan et al. 2021 §5.1: 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with full recomputation,
    72·B·s·l·h²·(1 + s/(6h) + V/(12lh)) without."""
    B, s, L, h, V = batch, seq_len, n_layers, d_model, vocab_size
    if recompute:
        return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def achieved_flops_per_gpu(flops_per_iteration: float, iteration_s: float, n_gpus: int) -> float:
    """FLOP/s per GPU = F / (iteration time · GPUs) (Narayanan et al. 2021 §5.1)."""
    return flops_per_iteration / (iteration_s * n_gpus)


def megatron_training_days(n_params: float, tokens: float, n_gpus: int, flops_per_gpu: float,
                           recompute: bool = True) -> float:
    """End-to-end training time ≈ 8·T·P/(n·X) with recomputation, 6·T·P/(n·X) without
    (Narayanan et al. 2021 §5.1), in days."""
    return (8.0 if recompute else 6.0) * tokens * n_params / (n_gpus * flops_per_gpu) / 86400.0


def gpus_needed(n_params: float, tokens: float, flops_per_gpu: float, days: float, utilisation: float = 1.0) -> float:
    """GPUs to train in ``days``: 6·N·D / (GPU FLOP/s · utilisation · seconds) — the classic
    estimate (e.g. GPT-3 175B on 300B tokens at 160 TFLOP/s effective in 30 days ≈ 760 ≈ 800 GPUs)."""
    return six_nd(n_params, tokens) / (flops_per_gpu * utilisation * days * 86400.0)


def training_days(n_params: float, tokens: float, flops_per_gpu: float, n_gpus: int, utilisation: float = 1.0) -> float:
    """Days to train on ``n_gpus``: 6·N·D / (n · GPU FLOP/s · utilisation) / 86400."""
    return six_nd(n_params, tokens) / (n_gpus * flops_per_gpu * utilisation) / 86400.0
