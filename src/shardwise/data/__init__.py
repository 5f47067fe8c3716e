"""Data: corpus sources, tokenizers, the memory-mapped token cache, windows and distributed sampling.

Typical use (the launcher prepares once in the parent; every rank may call it again, it is cached)::

    info = prepare_corpus(cfg.data, run_dir)
    windows = TokenWindows(info.train_path, cfg.data.seq_len, info.dtype)
    sampler = DistributedWindowSampler(len(windows), cfg.train.global_batch, cfg.train.seed, dp_rank, dp_size)
    for ids in sampler.micro_batches(step, cfg.train.micro_batch):
        x, y = windows.batch(ids)

The names below are imported on first use (:mod:`shardwise.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "BPETokenizer": "shardwise.data.tokenizer",
    "ByteTokenizer": "shardwise.data.tokenizer",
    "CorpusInfo": "shardwise.data.cache",
    "DataError": "shardwise.data.sources",
    "DistributedWindowSampler": "shardwise.data.sampler",
    "Document": "shardwise.data.sources",
    "Source": "shardwise.data.sources",
    "TokenWindows": "shardwise.data.sampler",
    "Tokenizer": "shardwise.data.tokenizer",
    "cache_root": "shardwise.data.cache",
    "is_validation": "shardwise.data.sources",
    "load_tokenizer": "shardwise.data.tokenizer",
    "open_source": "shardwise.data.sources",
    "prepare_corpus": "shardwise.data.cache",
    "read_meta": "shardwise.data.cache",
    "tokenizer_from_run": "shardwise.data.tokenizer",
    "val_indices": "shardwise.data.sampler",
}

__all__ = [
    "BPETokenizer", "ByteTokenizer", "CorpusInfo", "DataError", "DistributedWindowSampler", "Document",
    "Source", "TokenWindows", "Tokenizer", "cache_root", "is_validation", "load_tokenizer", "open_source",
    "prepare_corpus", "read_meta", "tokenizer_from_run", "val_indices",
]

if TYPE_CHECKING:
    from shardwise.data.cache import CorpusInfo, cache_root, prepare_corpus, read_meta
    from shardwise.data.sampler import DistributedWindowSampler, TokenWindows, val_indices
    from shardwise.data.sources import DataError, Document, Source, is_validation, open_source
    from shardwise.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_from_run

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
