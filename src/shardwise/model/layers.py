"""Building blocks of the decoder-only transformer: norms, rotary embeddings, attention, MLPs.

Plain single-device PyTorch. Every layer works on ``[batch, seq, features]`` tensors and reads
its head count from the width of its projections (``view(B, T, -1, head_dim)``), so a layer whose
projections hold only some of the heads computes the right thing for those heads.

Sources:
  * LayerNorm: Ba et al. 2016, "Layer Normalization".
  * RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4.
  * Rotary position embeddings: Su et al. 2021, "RoFormer", §3.4 (eq. 34), in the
    "rotate half" layout of GPT-NeoX (Black et al. 2022), which pairs dimension i with i + d/2.
  * Scaled dot-product attention: Vaswani et al. 2017, §3.2.1; multi-head attention §3.2.2.
  * Grouped-query attention: Ainslie et al. 2023, "GQA", §2.
  * GELU MLP: Radford et al. 2019 (GPT-2), Devlin et al. 2019 (BERT) after Hendrycks & Gimpel 2016.
  * SwiGLU MLP: Shazeer 2020, "GLU Variants Improve Transformer", eq. 6; Touvron et al. 2023 §2.2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.model.dropout import LANES, AttentionDropout, DropoutKey, Span, dropped_attention


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned gain (Zhang & Sennrich 2019, eq. 4).

    The statistic is computed in fp32 and the result cast back to the input dtype before the
    gain is applied, as in the Llama reference implementation (Touvron et al. 2023).
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer §3.4.2, eq. 34).

    Dimension pair ``(i, i + head_dim/2)`` of a query or key at position ``m`` is rotated by the
    angle ``m * theta^(-2i/head_dim)``, so that ``<R(m) q, R(n) k>`` depends on ``m - n`` only.

    The cos/sin tables (``[max_seq_len, head_dim/2]``, fp32) are non-persistent buffers: they are
    not part of ``state_dict`` and are rebuilt by :meth:`reset_parameters` (e.g. after a model
    built on the meta device is materialised with ``to_empty``). One instance is shared by all
    attention layers of a model.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the cos/sin tables: in float64 on the CPU (the same on every device), stored as fp32."""
        device = self.cos.device
        if device.type == "meta":
            return
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device="cpu") / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device="cpu"), inv_freq)
        self.cos = angles.cos().to(device=device, dtype=torch.float32)
        self.sin = angles.sin().to(device=device, dtype=torch.float32)

    def _apply(self, fn, recurse=True):
        # Keep the tables in fp32 when the module is cast (e.g. model.to(torch.bfloat16)).
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = self.cos.float(), self.sin.float()
            self.reset_parameters()
        return self

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape ``[B, H, T, head_dim]`` by the angles of positions ``0..T-1``, or of
        ``positions [B, T]`` (incremental decoding, left-padded batches)."""
        if positions is None:
            t = x.shape[-2]
            cos, sin = self.cos[:t].float(), self.sin[:t].float()
        else:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, T, hd/2]
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.type_as(x)

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q, positions), self.rotate(k, positions)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"


class Attention(nn.Module):
    """Causal multi-head self-attention (Vaswani et al. 2017, §3.2) with optional grouped-query
    key/value heads (Ainslie et al. 2023) and rotary positions (Su et al. 2021).

    Separate ``q_proj``, ``k_proj``, ``v_proj`` projections keep each head's columns contiguous,
    so that the heads can be split across devices from outside. Query head ``h`` attends with
    key/value head ``h // (n_heads / n_kv_heads)`` — ``scaled_dot_product_attention(enable_gqa=True)``
    is equivalent to repeating each key/value head ``n_heads / n_kv_heads`` times.
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
    ):
        super().__init__()
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"need n_heads | d_model and n_kv_heads | n_heads; got {d_model=}, {n_heads=}, {n_kv_heads=}"
            )
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        self.rope = rope
        self.causal = causal
        self.layer = layer
        self.heads: Span | None = None
        # QK-norm (Dehghani et al. 2023, §3.1; Qwen3): RMSNorm of every query and key head, one gain per head dim
        self.q_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, cache=None, padding_mask: torch.Tensor | None = None,
                dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """``x [B, T, d_model]``; with ``cache`` (a :class:`~shardwise.model.kv_cache.LayerCache`, for
        incremental decoding) the new keys and values are appended to the cached ones and the queries
        attend under the cache's mask at the cache's positions. ``padding_mask [B, T]`` (True = a real
        token; bidirectional attention only) keeps every query off the padded keys. ``dropout_key``: the
        draw of the probabilities' dropout masks (without one, torch's generator draws them)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H_kv, T, hd]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, k, None if cache is None else cache.positions)
        if cache is None:
            mask = None if padding_mask is None else padding_mask[:, None, None, :]
            drop = self.dropout_of(dropout_key, q.shape[1], x.device)
            y = self.core(q, k, v, mask) if drop is None else self.core(q, k, v, mask, drop)
        else:
            k, v = cache.append(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask, enable_gqa=k.shape[1] != q.shape[1])
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    def dropout_of(self, dropout_key: DropoutKey | None, n_heads: int, device) -> AttentionDropout | None:
        """This call's probability dropout, or None (evaluation, no dropout, or no key: torch draws the masks)."""
        if not self.training or not self.dropout or dropout_key is None:
            return None
        return AttentionDropout(self.dropout, dropout_key, self.layer, self.heads or Span.whole(n_heads, device))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
             drop: AttentionDropout | None = None) -> torch.Tensor:
        """The attention core on ``[B, H, T, hd]`` heads: causal (or, for an encoder, bidirectional)
        scores, softmax, dropout and the weighted sum of values (Vaswani et al. 2017, eq. 1) -- the part
        of a layer whose activations grow with T^2 in an eager implementation. ``mask``: keys each query may
        attend to (bert's padding mask, ``[B, 1, 1, T]``); ``drop``: the probabilities' dropout, whose mask is
        drawn for the ``T`` positions of the whole sequence (a core that sees part of it replaces this method)."""
        if drop is not None:
            t = q.shape[2]
            positions = torch.arange(t, device=q.device)
            causal = self.causal and mask is None
            keep = drop.keep(q.shape[0], positions, positions, t, causal=causal, keys_aligned=t % LANES == 0)
            return dropped_attention(q, k, v, keep, drop.p, causal=causal, mask=mask)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None,
            enable_gqa=k.shape[1] != q.shape[1],
        )


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


class SwiGLU(nn.Module):
    """Llama feed-forward block: ``down_proj(silu(gate_proj(x)) * up_proj(x))``
    (Shazeer 2020, eq. 6; Touvron et al. 2023, §2.2)."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
