"""A key/value cache for incremental decoding of a batch of left-padded sequences.

Autoregressive decoding recomputes nothing for tokens already seen if each attention layer keeps their
keys and values: a step feeds only the new token, whose query attends over the cached keys
(incremental decoding as in the Transformer's decoder, Vaswani et al. 2017 §3.2.3; the cache layout of
Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2). Buffers are preallocated for
``max_len`` slots per layer ``[B, H_kv, max_len, head_dim]``; keys are stored after the rotary rotation,
so a cached key never changes.

Prompts of different lengths share a batch by *left* padding: slot ``j`` of row ``b`` is ``valid`` or a
pad. A row's positions count only its valid slots (its first real token is position 0), and a query
attends to the valid slots at or before its own (plus itself, so a pad's row of scores is never empty
and its output stays finite; no real token ever attends to a pad).
"""

from __future__ import annotations

import torch


class KVCache:
    """Every layer's keys and values for the slots fed so far (``length``), their validity, and the
    positions and attention mask of the slots being fed. Use: ``model(tokens, cache=cache.feed(valid))``."""

    def __init__(self, n_layers: int, batch: int, max_len: int, device: torch.device | str = "cpu"):
        self.max_len, self.length = max_len, 0
        self.diagonal: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self.positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._new = 0

    def feed(self, valid: torch.Tensor) -> KVCache:
        """Prepare the next ``valid.shape[1]`` slots (``valid [B, T]``: False marks a pad)."""
        start, t = self.length, valid.shape[1]
        if start + t > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} slots; {start} are used and {t} more were fed")
        self.valid[:, start:start + t] = valid
        before = self.valid[:, :start].sum(1, keepdim=True)
        self.positions = (before + valid.long().cumsum(1) - 1).clamp(min=0)
        keys = torch.arange(start + t, device=valid.device)
        queries = keys[start:, None]
        self.diagonal = keys == queries
        self.mask = (self.valid[:, None, None, :start + t] & (keys <= queries)) | self.diagonal
        self.key_positions = self.valid[:, :start + t].long().cumsum(1) - 1  # [B, S]: each slot's position
        self._new = t
        return self

    def mask_within(self, window: int) -> torch.Tensor:
        """The mask of the fed slots' queries, restricted to keys less than ``window`` positions before each
        query (sliding-window attention; 0: none)."""
        if not window:
            return self.mask
        near = self.positions[:, :, None] - self.key_positions[:, None, :] < window  # [B, T, S]
        return (self.mask & near[:, None]) | self.diagonal  # a pad's own slot keeps its row finite

    def advance(self) -> None:
        """The fed slots are now cached (called by the model after its forward)."""
        self.length += self._new
        self._new = 0

    def __getitem__(self, layer_id: int) -> LayerCache:
        return self.layers[layer_id]


class LayerCache:
    """One attention layer's keys and values ``[B, H_kv, slots, head_dim]``."""

    def __init__(self, parent: KVCache):
        self.parent = parent
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self.parent.positions

    @property
    def mask(self) -> torch.Tensor:
        return self.parent.mask

    def mask_within(self, window: int) -> torch.Tensor:
        return self.parent.mask_within(window)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new slots' keys and values (``[B, H, new, d]`` each, their own ``H`` and ``d``: a latent
        attention caches its compressed keys and values); return all of them so far."""
        if self.k is None:
            slots = self.parent.max_len
            self.k = k.new_empty(k.shape[0], k.shape[1], slots, k.shape[3])
            self.v = v.new_empty(v.shape[0], v.shape[1], slots, v.shape[3])
        start, end = self.parent.length, self.parent.length + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]
