"""The config rules of the data and the training objective, functions of the config (the source's kind is
read from disk only where a rule needs it)."""

from __future__ import annotations

from pathlib import Path

from shardwise.checks import Unused, choice, positive
from shardwise.config import CHOICES, Config, ConfigError, DataConfig


def check_source(cfg: Config) -> None:
    """The source and tokenizer exist; sizes in range (before data.seq_len is filled from the model)."""
    d = cfg.data
    choice("data.format", d.format)
    if d.source != "stdlib" and not Path(d.source).exists():
        raise ConfigError(f"data.source={d.source!r} does not exist; give a file or directory, or 'stdlib'")
    if d.tokenizer not in CHOICES["data.tokenizer"] and not Path(d.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is neither 'byte', 'bpe' nor an existing tokenizer.json")
    if d.tokenizer == "bpe" and d.bpe_vocab_size < 260:
        raise ConfigError(f"data.bpe_vocab_size={d.bpe_vocab_size} is too small; use at least 260")


def check(cfg: Config) -> None:
    """The windows fit the model; the objective suits the flavour (mlm and classify are bert's)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    positive("data.seq_len", d.seq_len)
    if d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; use at most {m.max_seq_len}"
        )
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    positive("data.max_bytes", d.max_bytes, allow_zero=True)
    choice("train.objective", t.objective)
    if t.objective != "causal" and m.flavor != "bert":
        raise ConfigError(f"train.objective={t.objective!r} is for the bidirectional bert flavour, but model.flavor="
                          f"{m.flavor!r} is causal; set model.flavor='bert' or train.objective='causal'")
    if t.objective == "classify":
        if m.n_classes < 2:
            raise ConfigError(f"model.n_classes={m.n_classes}: train.objective='classify' needs the number of "
                              "classes (at least 2)")
        kind = source_kind(d)
        if kind is not None and kind not in ("jsonl", "parquet"):
            raise ConfigError(f"train.objective='classify' reads a label per document from a jsonl or parquet "
                              f"data.source, but data.source={d.source!r}; give such a file or directory")
    if m.flavor == "bert" and t.objective == "causal":
        raise ConfigError("model.flavor='bert' is a bidirectional encoder: train.objective='causal' would "
                          "let every token see its target; set train.objective='mlm' or 'classify'")


def source_kind(d: DataConfig) -> str | None:
    """What ``data.source`` is read as ("stdlib", "text", "jsonl", "parquet", "hf"); None: unknown (the data
    layer names the problem when it reads the source)."""
    from shardwise.data.sources import DataError, open_source

    try:
        return open_source(d.source, d.format).kind
    except DataError:
        return None


def unused(cfg: Config) -> list[Unused]:
    d, t = cfg.data, cfg.train
    # a directory's format is found by scanning it: only looked at when data.text_field is set
    text_read = d.text_field == DataConfig.text_field or source_kind(d) not in ("stdlib", "text")
    return [
        Unused("data.format", d.source != "stdlib", "describes a data.source file or directory, but "
               "data.source='stdlib' is the standard library's .py files; give data.source a path or remove it"),
        Unused("data.text_field", text_read, f"names a jsonl field or a parquet / hf column, but data.source="
               f"{d.source!r} is read as plain text; remove it or give such a data.source"),
        Unused("data.bpe_vocab_size", d.tokenizer == "bpe", f"sizes a trained BPE tokenizer, but data.tokenizer="
               f"{d.tokenizer!r}; set data.tokenizer='bpe' or remove it"),
        Unused("model.n_classes", t.objective == "classify", f"sizes the classifier of train.objective='classify', "
               f"but train.objective={t.objective!r}; set train.objective='classify' or remove it"),
        Unused("data.label_field", t.objective == "classify", f"names the label of train.objective='classify', but "
               f"train.objective={t.objective!r}; set train.objective='classify' or remove it"),
    ]
