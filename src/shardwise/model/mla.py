"""Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", §2.1; "DeepSeek-V3 Technical Report", §2.1.1),
as plain single-device code.

Keys and values are compressed into one latent vector per token, ``c = norm(W_DKV h)`` of width
``kv_rank`` (eq. 9), from which each head's key part ``k^C`` and value ``v`` are projected back up by one
matrix (``kv_b_proj``, eq. 10-11); queries go through a low-rank pair of their own (``q_a_proj``, a norm,
``q_b_proj``: eq. 12-13), or one full projection when ``q_rank`` is 0. Rotary positions cannot pass through
the up-projection, so they are *decoupled* (§2.1.3, eq. 14-19): each query head has ``rope_dim`` extra dims
rotated, and one rotated key part of ``rope_dim`` dims, projected from ``h`` beside the latent, is shared by
every head. The score of head ``i`` is ``[q^C_i; q^R_i] . [k^C_i; k^R]``; its width ``nope_dim + rope_dim``
sets the scale ``1/sqrt(nope_dim + rope_dim)`` (times YaRN's squared ``mscale`` when the rotary embedding is
scaled: :func:`~shardwise.model.rope_scaling.softmax_scale_factor`), and values are ``v_dim`` wide.

Decoding caches what the paper caches (§2.1.2): the latent and the shared rotated key part, ``kv_rank +
rope_dim`` numbers per token and layer, expanded into every head's keys and values at each step.

Heads are read from the widths of ``q_b_proj`` / ``kv_b_proj`` (each head's rows contiguous), so a layer that
holds only some heads computes them; the down-projections and their norms are whole on every such layer.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.model.dropout import DropoutKey
from shardwise.model.layers import Attention, RMSNorm, cached_attention
from shardwise.model.rope import RotaryEmbedding
from shardwise.model.scores import ScoreRule


class LatentAttention(Attention):
    """Multi-head latent attention; an :class:`~shardwise.model.layers.Attention` for every code that swaps or
    wraps the attention core (context parallelism, selective recomputation, dropout placement), with its own
    projections (the parent's are not built)."""

    def __init__(self, d_model: int, n_heads: int, *, q_rank: int, kv_rank: int, nope_dim: int, rope_dim: int,
                 v_dim: int, rope: RotaryEmbedding, eps: float, layer: int = 0, dropout: float = 0.0,
                 scale_factor: float = 1.0):
        nn.Module.__init__(self)
        qk = nope_dim + rope_dim
        self.head_dim, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = qk, nope_dim, rope_dim, v_dim, kv_rank
        self.dropout, self.layer, self.causal, self.heads = dropout, layer, True, None
        self.rule = ScoreRule(scale=qk ** -0.5 * scale_factor)
        self.rope = rope
        if q_rank:
            self.q_a_proj = nn.Linear(d_model, q_rank, bias=False)
            self.q_norm = RMSNorm(q_rank, eps)
            self.q_b_proj = nn.Linear(q_rank, n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d_model, n_heads * qk, bias=False)
        self.kv_a_proj = nn.Linear(d_model, kv_rank + rope_dim, bias=False)
        self.kv_norm = RMSNorm(kv_rank, eps)
        self.kv_b_proj = nn.Linear(kv_rank, n_heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_dim, d_model, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, nope_dim + rope_dim]`` from ``x [B, T, d_model]`` (eq. 12-13, or one projection)."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_norm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        return q.view(b, t, -1, self.head_dim).transpose(1, 2)

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys ``[B, H, S, nope + rope]`` and values ``[B, H, S, v_dim]`` from the latents
        ``[B, S, kv_rank]`` and the shared rotated key part ``[B, 1, S, rope_dim]`` (eq. 10-11, 17)."""
        b, s, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1), v

    def forward(self, x: torch.Tensor, cache=None, padding_mask: torch.Tensor | None = None,
                dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """``x [B, T, d_model]``; with ``cache`` the new latents and rotated key parts are appended to the cached
        ones (:class:`~shardwise.model.kv_cache.LayerCache`), and every head's keys and values re-expanded."""
        if padding_mask is not None:
            raise ValueError("latent attention is causal: it takes no padding mask")
        b, t, _ = x.shape
        q = self.queries(x)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = k_rope.view(b, 1, t, self.rope_dim)
        positions = None if cache is None else cache.positions
        q_rope, k_rope = self.rope(q_rope, k_rope, positions)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if cache is None:
            k, v = self.expand(latent, k_rope)
            y = self.core(q, k, v, None, self.dropout_of(dropout_key, q.shape[1], x.device), self.rule)
        else:
            latents, k_ropes = cache.append(latent.unsqueeze(1), k_rope)
            k, v = self.expand(latents.squeeze(1), k_ropes)
            y = cached_attention(q, k, v, cache, self.rule)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
