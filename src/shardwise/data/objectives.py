"""What the training loop reads for each ``train.objective``: the same ``batch(ids) -> (inputs, targets)``
interface over next-token windows (causal), masked windows (mlm, :mod:`shardwise.data.mlm`) or labelled
sequences (classify, :mod:`shardwise.data.labelled`), so the step-indexed sampler and the engines are the same
for all three."""

from __future__ import annotations

from shardwise.data.mlm import MaskedWindows
from shardwise.data.sampler import TokenWindows


def objective_windows(cfg, corpus, split: str):
    """What the loop trains (``split`` "train") or evaluates ("val") on for ``cfg.train.objective``: next-token
    windows, masked windows (mlm) or labelled sequences (classify); each has ``batch(ids) -> (inputs, targets)``."""
    if cfg.train.objective == "classify":
        from shardwise.data.labelled import labelled_split

        return labelled_split(cfg, corpus, split)
    windows = TokenWindows(corpus.train_path if split == "train" else corpus.val_path, cfg.data.seq_len)
    if cfg.train.objective == "mlm":
        from shardwise.model.transformer import bert_special_ids

        _pad, _cls, mask = bert_special_ids(cfg.model.vocab_size)
        return MaskedWindows(windows, mask_id=mask, seed=cfg.train.seed, n_random=_pad)
    return windows
