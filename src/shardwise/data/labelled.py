"""Labelled sequences for classification: one example per document of a jsonl or parquet source.

Each document's text (``data.text_field``) is tokenized, cut to ``seq_len - 1`` tokens after a leading
[CLS] and padded with [PAD] (bert's special ids, :func:`shardwise.model.transformer.bert_special_ids`); its
label (``data.label_field``) must be an integer in ``[0, n_classes)``. Documents are split into training
and validation by the hash of their name, as the language-model corpora are
(:func:`shardwise.data.sources.is_validation`), and kept in memory (a classification set is small next to
a pre-training corpus). ``batch(ids)`` gives ``(tokens [B, seq_len], labels [B])`` like
:meth:`TokenWindows.batch`, so the step-indexed sampler and every engine take it unchanged.
"""

from __future__ import annotations

import json

import torch

from shardwise.data.sources import DataError, is_validation, open_source


def read_labelled(data_cfg, label_field: str) -> list[tuple[str, str, int]]:
    """``(name, text, label)`` of every document, named as :class:`~shardwise.data.sources.Source` names them."""
    source = open_source(data_cfg.source, data_cfg.format, data_cfg.text_field)
    if source.kind not in ("jsonl", "parquet"):
        raise DataError(f"classification reads jsonl or parquet, but data.source={data_cfg.source!r} is {source.kind}")
    rows: list[tuple[str, str, int]] = []
    for path in source._files(frozenset({".jsonl", ".ndjson"} if source.kind == "jsonl" else {".parquet"})):
        name = source._name(path)
        if source.kind == "jsonl":
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        row = json.loads(line)
                        where = f"line {lineno} of {path}"
                        rows.append((f"{name}:{lineno}", _text(row, data_cfg.text_field, where),
                                     _label(row, label_field, where)))
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path, columns=[data_cfg.text_field, label_field]).to_pylist()
            for i, row in enumerate(table):
                label = _label(row, label_field, f"row {i} of {path}")
                rows.append((f"{name}:{i}", row[data_cfg.text_field] or "", label))
    return rows


def _text(row: dict, field: str, where: str) -> str:
    if field not in row:
        raise DataError(f"{where} has no field {field!r}; set data.text_field")
    return row[field] or ""


def _label(row: dict, field: str, where: str) -> int:
    value = row.get(field)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"{where}: label field {field!r} is {value!r}, not an integer; set data.label_field")
    return value


class LabelledSequences:
    """The training or validation documents as padded ``[CLS] text`` sequences and their labels."""

    def __init__(self, rows: list[tuple[str, str, int]], tokenizer, seq_len: int, vocab_size: int, n_classes: int):
        from shardwise.model.transformer import bert_special_ids

        pad, cls, _mask = bert_special_ids(vocab_size)
        self.tokens = torch.full((len(rows), seq_len), pad, dtype=torch.long)
        self.tokens[:, 0] = cls
        self.labels = torch.tensor([label for _, _, label in rows], dtype=torch.long)
        bad = [(name, label) for name, _, label in rows if not 0 <= label < n_classes]
        if bad:
            raise DataError(f"document {bad[0][0]} has label {bad[0][1]}, outside 0..{n_classes - 1} "
                            f"(model.n_classes={n_classes}); {len(bad)} such documents")
        for i, ids in enumerate(tokenizer.encode_batch([text for _, text, _ in rows])):
            ids = ids[:seq_len - 1]
            self.tokens[i, 1:1 + len(ids)] = torch.tensor(ids, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.as_tensor(ids, dtype=torch.long)
        return self.tokens[ids], self.labels[ids]


def labelled_split(cfg, corpus, split: str) -> LabelledSequences:
    """The ``split`` ("train" or "val") documents of ``cfg.data`` for ``train.objective = "classify"``."""
    rows = read_labelled(cfg.data, cfg.data.label_field)
    rows = [r for r in rows if is_validation(r[0], cfg.data.val_fraction) == (split == "val")]
    return LabelledSequences(rows, corpus.tokenizer(), cfg.data.seq_len, cfg.model.vocab_size, cfg.model.n_classes)
