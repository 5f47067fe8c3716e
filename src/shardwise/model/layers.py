"""Building blocks of the decoder-only transformer: norms, attention, MLPs.

Plain single-device PyTorch. Every layer works on ``[batch, seq, features]`` tensors and reads
its head count from the width of its projections (``view(B, T, -1, head_dim)``), so a layer whose
projections hold only some of the heads computes the right thing for those heads.

Sources:
  * LayerNorm: Ba et al. 2016, "Layer Normalization".
  * RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4.
  * Rotary position embeddings: :mod:`shardwise.model.rope`; the scores' scale, window and soft-cap:
    :mod:`shardwise.model.scores`.
  * Scaled dot-product attention: Vaswani et al. 2017, §3.2.1; multi-head attention §3.2.2.
  * Grouped-query attention: Ainslie et al. 2023, "GQA", §2.
  * GELU MLP: Radford et al. 2019 (GPT-2), Devlin et al. 2019 (BERT) after Hendrycks & Gimpel 2016.
  * SwiGLU MLP: Shazeer 2020, "GLU Variants Improve Transformer", eq. 6; Touvron et al. 2023 §2.2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.model.dropout import LANES, AttentionDropout, DropoutKey, Span
from shardwise.model.rope import RotaryEmbedding
from shardwise.model.scores import PLAIN, ScoreRule, allowed, attend


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned gain (Zhang & Sennrich 2019, eq. 4).

    The statistic is computed in fp32 and the result cast back to the input dtype before the
    gain is applied, as in the Llama reference implementation (Touvron et al. 2023). With ``unit_offset``
    the gain is ``1 + weight`` applied in fp32 before the cast (Gemma's norms, Gemma Team 2024), and the
    weight starts at zero (:func:`~shardwise.model.transformer.initial_value` reads :attr:`unit_offset`).
    """

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def statistic(self, x32: torch.Tensor) -> torch.Tensor:
        """The mean of squares over the last dim (fp32); a norm split over ranks replaces it by the whole one's."""
        return x32.pow(2).mean(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(self.statistic(x32) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", unit_offset" if self.unit_offset else "")


class Attention(nn.Module):
    """Causal multi-head self-attention (Vaswani et al. 2017, §3.2) with optional grouped-query
    key/value heads (Ainslie et al. 2023) and rotary positions (Su et al. 2021).

    Separate ``q_proj``, ``k_proj``, ``v_proj`` projections keep each head's columns contiguous,
    so that the heads can be split across devices from outside. Query head ``h`` attends with
    key/value head ``h // (n_heads / n_kv_heads)`` — ``scaled_dot_product_attention(enable_gqa=True)``
    is equivalent to repeating each key/value head ``n_heads / n_kv_heads`` times.

    ``head_dim`` (default ``d_model / n_heads``) may differ from ``d_model / n_heads``: the projections are then
    ``n_heads * head_dim`` wide (Qwen3, Gemma). ``qkv_bias``: biases on q, k and v only (Qwen2, Bai et al.
    2023 §2.2). ``rule``: the scores' scale, sliding window and soft-cap (:class:`~.scores.ScoreRule`).
    QK-norm (``qk_norm_eps``) normalises each head (``qk_norm_scope="head"``: Qwen3, Gemma 3) or the whole q
    and k projections (``"projection"``: OLMo 2, Team OLMo 2024 §3.1) before the rotation.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        bias: bool,
        dropout: float = 0.0,
        rope: RotaryEmbedding | None = None,
        causal: bool = True,
        layer: int = 0,
        qk_norm_eps: float | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        rule: ScoreRule = PLAIN,
        qk_norm_scope: str = "head",
        unit_offset: bool = False,
    ):
        super().__init__()
        if (head_dim is None and d_model % n_heads) or n_heads % n_kv_heads:
            raise ValueError(
                f"need n_heads | d_model and n_kv_heads | n_heads; got {d_model=}, {n_heads=}, {n_kv_heads=}"
            )
        self.head_dim = head_dim or d_model // n_heads
        self.dropout = dropout
        inner, kv = n_heads * self.head_dim, n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=bias or qkv_bias)
        self.k_proj = nn.Linear(d_model, kv, bias=bias or qkv_bias)
        self.v_proj = nn.Linear(d_model, kv, bias=bias or qkv_bias)
        self.o_proj = nn.Linear(inner, d_model, bias=bias)
        self.rope = rope
        self.causal = causal
        self.layer = layer
        self.rule = rule
        self.heads: Span | None = None
        self.qk_norm_scope = qk_norm_scope
        # QK-norm (Dehghani et al. 2023, §3.1): RMSNorm of every query and key head (one gain per head dim, Qwen3),
        # or of the whole projections (OLMo 2)
        widths = (self.head_dim, self.head_dim) if qk_norm_scope == "head" else (inner, kv)
        self.q_norm = RMSNorm(widths[0], qk_norm_eps, unit_offset) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(widths[1], qk_norm_eps, unit_offset) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, cache=None, padding_mask: torch.Tensor | None = None,
                dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """``x [B, T, d_model]``; with ``cache`` (a :class:`~shardwise.model.kv_cache.LayerCache`, for
        incremental decoding) the new keys and values are appended to the cached ones and the queries
        attend under the cache's mask at the cache's positions. ``padding_mask [B, T]`` (True = a real
        token; bidirectional attention only) keeps every query off the padded keys. ``dropout_key``: the
        draw of the probabilities' dropout masks (without one, torch's generator draws them)."""
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        whole = self.q_norm is not None and self.qk_norm_scope != "head"
        if whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H_kv, T, hd]
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and not whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, k, None if cache is None else cache.positions)
        if cache is None:
            mask = None if padding_mask is None else padding_mask[:, None, None, :]
            drop = self.dropout_of(dropout_key, q.shape[1], x.device)
            y = self.core(q, k, v, mask, drop, self.rule)
        else:
            k, v = cache.append(k, v)
            y = cached_attention(q, k, v, cache, self.rule)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    def dropout_of(self, dropout_key: DropoutKey | None, n_heads: int, device) -> AttentionDropout | None:
        """This call's probability dropout, or None (evaluation, no dropout, or no key: torch draws the masks)."""
        if not self.training or not self.dropout or dropout_key is None:
            return None
        return AttentionDropout(self.dropout, dropout_key, self.layer, self.heads or Span.whole(n_heads, device))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
             drop: AttentionDropout | None = None, rule: ScoreRule | None = None) -> torch.Tensor:
        """The attention core on ``[B, H, T, hd]`` heads: causal (or, for an encoder, bidirectional)
        scores under ``rule`` (default the layer's), softmax, dropout and the weighted sum of values (Vaswani et
        al. 2017, eq. 1) -- the part of a layer whose activations grow with T^2 in an eager implementation.
        ``mask``: keys each query may attend to (bert's padding mask, ``[B, 1, 1, T]``); ``drop``: the
        probabilities' dropout, whose mask is drawn for the ``T`` positions of the whole sequence (a core that
        sees part of it replaces this method)."""
        rule = self.rule if rule is None else rule
        causal = self.causal and mask is None
        p = self.dropout if self.training else 0.0
        if drop is not None:
            positions = torch.arange(q.shape[2], device=q.device)
            keep = drop.keep(q.shape[0], positions, positions, q.shape[2], causal=causal,
                             keys_aligned=q.shape[2] % LANES == 0)
            return attend(q, k, v, rule, causal=causal, mask=mask, keep=keep, p=drop.p)
        if rule.softcap:  # no fused kernel soft-caps: the eager core (torch's generator draws a dropout)
            return attend(q, k, v, rule, causal=causal, mask=mask, p=p)
        if rule.window:
            positions = torch.arange(q.shape[2], device=q.device)
            window = allowed(positions, positions, causal, rule.window)
            mask, causal = window if mask is None else window & mask, False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                              scale=rule.scale, enable_gqa=k.shape[1] != q.shape[1])


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, rule: ScoreRule) -> torch.Tensor:
    """Incremental decoding: the new queries over every cached key under the cache's mask (its validity and
    causality) and the rule's window at the slots' positions."""
    mask = cache.mask_within(rule.window)
    if rule.softcap:
        return attend(q, k, v, rule, causal=False, mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=rule.scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


class GeluMLP(nn.Module):
    """GPT-2 / BERT feed-forward block: ``fc_out(gelu(fc_in(x)))`` (Radford et al. 2019, with the
    tanh-approximate GELU of the released GPT-2 code; BERT, Devlin et al. 2019, with the exact erf GELU:
    ``approximate="none"``; Hendrycks & Gimpel 2016)."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = True, approximate: str = "tanh"):
        super().__init__()
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


GATED_ACTIVATIONS = ("silu", "gelu_tanh")
"""The gate activations of :class:`SwiGLU`: SiLU (SwiGLU) or the tanh-approximate GELU (GeGLU)."""


class SwiGLU(nn.Module):
    """Llama feed-forward block: ``down_proj(act(gate_proj(x)) * up_proj(x))`` with ``act`` SiLU (SwiGLU:
    Shazeer 2020, eq. 6; Touvron et al. 2023, §2.2) or, ``activation="gelu_tanh"``, the tanh-approximate GELU
    (GeGLU: Shazeer 2020, eq. 5; Gemma Team 2024)."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = False, activation: str = "silu"):
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"gated MLP activation {activation!r} is not one of {GATED_ACTIVATIONS}")
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))
