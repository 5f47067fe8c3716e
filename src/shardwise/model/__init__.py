"""Plain single-device model code: a transformer (GPT-2 and Llama decoders, a BERT encoder) and sampling
(with a key/value cache).

Parallelism is applied from outside (``shardwise.parallel``); nothing here knows about it.

The names below are imported lazily (PEP 562), so that ``shardwise.config`` can read
``shardwise.model.presets`` without importing torch or this package's model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Transformer": "shardwise.model.transformer",
    "Block": "shardwise.model.transformer",
    "initial_value": "shardwise.model.transformer",
    "generate": "shardwise.model.generate",
    "generate_batch": "shardwise.model.generate",
    "KVCache": "shardwise.model.kv_cache",
    "Attention": "shardwise.model.layers",
    "GeluMLP": "shardwise.model.layers",
    "RMSNorm": "shardwise.model.layers",
    "RotaryEmbedding": "shardwise.model.layers",
    "SwiGLU": "shardwise.model.layers",
}

__all__ = [
    "Attention",
    "Block",
    "GeluMLP",
    "KVCache",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "generate",
    "generate_batch",
    "initial_value",
]

if TYPE_CHECKING:
    from shardwise.model.generate import generate, generate_batch
    from shardwise.model.kv_cache import KVCache
    from shardwise.model.layers import Attention, GeluMLP, RMSNorm, RotaryEmbedding, SwiGLU
    from shardwise.model.transformer import Block, Transformer, initial_value


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
