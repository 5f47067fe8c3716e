"""Plain single-device model code: a transformer (GPT-2 and Llama decoders -- the latter with the variations of
the released families: head widths, rotary scaling, sliding windows, Gemma's norms and soft-caps, OLMo 2's norms,
DeepSeek's latent attention -- and a BERT encoder) and sampling (with a key/value cache).

Parallelism is applied from outside (``shardwise.parallel``); nothing here knows about it.

The names below are imported on first use (:mod:`shardwise.lazy`), so that ``shardwise.config`` can read
``shardwise.model.presets`` without importing torch or this package's model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "Attention": "shardwise.model.layers",
    "Block": "shardwise.model.transformer",
    "GeluMLP": "shardwise.model.layers",
    "KVCache": "shardwise.model.kv_cache",
    "LatentAttention": "shardwise.model.mla",
    "RMSNorm": "shardwise.model.layers",
    "RotaryEmbedding": "shardwise.model.rope",
    "SwiGLU": "shardwise.model.layers",
    "Transformer": "shardwise.model.transformer",
    "generate_batch": "shardwise.model.generate",
    "initial_value": "shardwise.model.transformer",
}

__all__ = [
    "Attention", "Block", "GeluMLP", "KVCache", "LatentAttention", "RMSNorm", "RotaryEmbedding", "SwiGLU",
    "Transformer",
    "generate_batch", "initial_value",
]

if TYPE_CHECKING:
    from shardwise.model.generate import generate_batch
    from shardwise.model.kv_cache import KVCache
    from shardwise.model.layers import Attention, GeluMLP, RMSNorm, SwiGLU
    from shardwise.model.mla import LatentAttention
    from shardwise.model.rope import RotaryEmbedding
    from shardwise.model.transformer import Block, Transformer, initial_value

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
