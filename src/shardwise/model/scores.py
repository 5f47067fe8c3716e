"""How one attention layer turns queries and keys into probabilities, and the eager attention that applies it.

Scaled dot-product attention (Vaswani et al. 2017, §3.2.1, eq. 1) with the variations of the released model
families, gathered in a :class:`ScoreRule` per layer:

* ``scale``: the scores' multiplier, ``1/sqrt(d)`` by default; Gemma's ``query_pre_attn_scalar`` (Gemma Team
  2024, "Gemma 2", §2) and DeepSeek's YaRN temperature (DeepSeek-V2 §2.1.3) set their own;
* ``window``: sliding-window attention (Beltagy et al. 2020, "Longformer", §3.1; Jiang et al. 2023,
  "Mistral 7B", §2): a query at position ``i`` attends to keys ``j`` with ``i - window < j <= i``;
* ``softcap``: logit soft-capping ``cap * tanh(s / cap)`` of the scores before the mask (Gemma 2, §2; Bello
  et al. 2016).

:func:`attend` computes the whole thing in fp32 on any query and key positions (the global ones of a
context-parallel rank's tokens too) with an optional dropout mask drawn from outside
(:class:`~shardwise.model.dropout.AttentionDropout`); the model's core takes
``torch.nn.functional.scaled_dot_product_attention`` instead where it can (no soft-cap, no drawn mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwise.model.dropout import apply_keep


@dataclass(frozen=True)
class ScoreRule:
    """The scale, window and soft-cap of one layer's attention scores (see the module docstring)."""

    scale: float | None = None
    """Multiplier of ``q . k``; None: ``1 / sqrt(d)`` for queries of width ``d``."""
    window: int = 0
    """Keys a causal query sees, itself included (0: the whole prefix)."""
    softcap: float = 0.0
    """``cap`` of ``cap * tanh(scores / cap)`` (0: none)."""

    def scale_for(self, d: int) -> float:
        return self.scale if self.scale is not None else d ** -0.5

    @property
    def plain(self) -> bool:
        """Whether nothing but the scale differs from ordinary attention."""
        return not self.window and not self.softcap


PLAIN = ScoreRule()


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int) -> torch.Tensor | None:
    """``[T, S]`` bool: which keys (positions ``k_pos [S]``) each query (``q_pos [T]``) may attend to; None for
    all of them."""
    if not causal and not window:
        return None
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    return ok & (diff < window) if window else ok


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule: ScoreRule = PLAIN, *, causal: bool,
           mask: torch.Tensor | None = None, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
           keep: torch.Tensor | None = None, p: float = 0.0) -> torch.Tensor:
    """Softmax attention of ``q [B, H, T, d]`` over ``k [B, Hkv, S, d]``, ``v [B, Hkv, S, dv]`` under ``rule``,
    in fp32, returned in ``v``'s dtype. Grouped-query attention: query head ``h`` uses key/value head
    ``h // (H / Hkv)`` (Ainslie et al. 2023). ``causal`` and the rule's window apply to the query and key
    positions ``q_pos [T]``, ``k_pos [S]`` (default ``0..T-1``, ``0..S-1``); ``mask`` (bool, broadcast to
    ``[B, H, T, S]``, True = may attend) restricts further; ``keep [B, H, T, S]``: the probabilities' dropout
    mask with probability ``p`` (without one, ``p`` drops by torch's generator)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * rule.scale_for(q.shape[-1])
    if rule.softcap:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    t, s = scores.shape[-2:]
    q_pos = torch.arange(t, device=q.device) if q_pos is None else q_pos
    k_pos = torch.arange(s, device=q.device) if k_pos is None else k_pos
    ok = allowed(q_pos, k_pos, causal, rule.window)
    if mask is not None:
        ok = mask if ok is None else ok & mask
    if ok is not None:
        scores = scores.masked_fill(~ok, float("-inf"))
    probs = scores.softmax(-1)
    if keep is not None:
        probs = apply_keep(probs, keep, p)
    elif p:  # no drawn mask: torch's generator draws one, as scaled_dot_product_attention(dropout_p=p) does
        probs = F.dropout(probs, p)
    return torch.matmul(probs, v.float()).to(v.dtype)
