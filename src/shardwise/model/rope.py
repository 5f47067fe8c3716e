"""Rotary position embeddings (Su et al. 2021, "RoFormer", §3.4.2, eq. 34), with frequency scaling
(:mod:`shardwise.model.rope_scaling`), partial rotation and the interleaved pair layout.

Pairs of dimensions of a query or key at position ``m`` are rotated by ``m * f_i`` for frequencies ``f_i``
(``theta^(-2i/dim)`` before scaling), so that ``<R(m) q, R(n) k>`` depends on ``m - n`` only. Which dimensions
pair up:

* the "rotate half" layout of GPT-NeoX (Black et al. 2022) and the ``transformers`` Llama checkpoints:
  ``(i, i + dim/2)``;
* ``interleaved``: ``(2i, 2i + 1)``, the original RoFormer layout, kept by DeepSeek's checkpoints for the
  rotary part of multi-head latent attention. The rotated pairs come out in the rotate-half order (even dims,
  then odd), as ``transformers`` lays them out; queries and keys are permuted alike, so the scores equal
  those of rotating in place.

Only the first ``dim`` dimensions of a head are rotated when the head is wider (partial rotary, as
Phi-3's ``partial_rotary_factor``); the rest pass through unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.model.rope_scaling import inverse_frequencies, parse_rope_scaling


class RotaryEmbedding(nn.Module):
    """The rotation of the first ``dim`` dimensions of each head, for positions ``0 .. max_seq_len - 1``.

    The cos/sin tables (``[max_seq_len, dim/2]``, fp32, already multiplied by a YaRN attention factor) are
    non-persistent buffers: not part of ``state_dict``, rebuilt by :meth:`reset_parameters` (e.g. after a
    model built on the meta device is materialised with ``to_empty``). One instance is shared by the layers
    that rotate alike."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, dim: int, max_seq_len: int, theta: float = 10000.0, scaling: str = "", *,
                 interleaved: bool = False):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary embeddings need an even rotated width, got {dim}")
        self.dim, self.max_seq_len, self.theta = dim, max_seq_len, theta
        self.scaling, self.interleaved = scaling, interleaved
        self.register_buffer("cos", torch.empty(max_seq_len, dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, dim // 2), persistent=False)
        self.reset_parameters()

    @property
    def head_dim(self) -> int:
        return self.dim

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the cos/sin tables: in float64 on the CPU (the same on every device), stored as fp32."""
        device = self.cos.device
        if device.type == "meta":
            return
        freqs, factor = inverse_frequencies(self.dim, self.theta, parse_rope_scaling(self.scaling))
        inv_freq = torch.tensor(freqs, dtype=torch.float64)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        self.cos = (angles.cos() * factor).to(device=device, dtype=torch.float32)
        self.sin = (angles.sin() * factor).to(device=device, dtype=torch.float32)

    def _apply(self, fn, recurse=True):
        # Keep the tables in fp32 when the module is cast (e.g. model.to(torch.bfloat16)).
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = self.cos.float(), self.sin.float()
            self.reset_parameters()
        return self

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape ``[B, H, T, head_dim]`` by the angles of positions ``0..T-1``, or of
        ``positions [B, T]`` (incremental decoding, left-padded batches, a context-parallel rank's tokens)."""
        if positions is None:
            t = x.shape[-2]
            cos, sin = self.cos[:t], self.sin[:t]
        else:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, T, dim/2]
        x32 = x.float()
        rot, rest = x32[..., :self.dim], x32[..., self.dim:]
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if self.interleaved else rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
        return out.type_as(x)

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q, positions), self.rotate(k, positions)

    def extra_repr(self) -> str:
        extra = f", scaling={self.scaling!r}" if self.scaling else ""
        extra += ", interleaved" if self.interleaved else ""
        return f"dim={self.dim}, max_seq_len={self.max_seq_len}, theta={self.theta}{extra}"
