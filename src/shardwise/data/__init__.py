"""Data: corpus sources, tokenizers, the memory-mapped token cache, windows and distributed sampling.

Typical use (the launcher prepares once in the parent; every rank may call it again, it is cached)::

    info = prepare_corpus(cfg.data, run_dir)
    windows = TokenWindows(info.train_path, cfg.data.seq_len, info.dtype)
    sampler = DistributedWindowSampler(len(windows), cfg.train.global_batch, cfg.train.seed, dp_rank, dp_size)
    for ids in sampler.micro_batches(step, cfg.train.micro_batch):
        x, y = windows.batch(ids)
"""

from shardwise.data.cache import CorpusInfo, cache_root, prepare_corpus, read_meta
from shardwise.data.sampler import DistributedWindowSampler, TokenWindows, val_indices
from shardwise.data.sources import DataError, Document, Source, is_validation, open_source
from shardwise.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_from_run

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CorpusInfo",
    "DataError",
    "DistributedWindowSampler",
    "Document",
    "Source",
    "TokenWindows",
    "Tokenizer",
    "cache_root",
    "is_validation",
    "load_tokenizer",
    "open_source",
    "prepare_corpus",
    "read_meta",
    "tokenizer_from_run",
    "val_indices",
]
