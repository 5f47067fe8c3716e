"""Corpus sources: iterate the documents ``(name, text)`` of a corpus, and split them by name.

A source is described by ``data.source`` / ``data.format`` / ``data.text_field`` /
``data.max_bytes`` (see :class:`shardwise.config.DataConfig`):

- ``"stdlib"``: the ``.py`` files of the running Python's standard library (the default corpus);
- a directory of text files, a ``.txt`` file, a ``.jsonl`` file (or a directory of them),
  a ``.parquet`` file (or a directory of them), or a Hugging Face dataset saved with
  ``save_to_disk`` (needs the optional ``datasets`` package: ``pip install 'shardwise[hf]'``).

Documents are yielded in a fixed order (files sorted by path), so a corpus always reads the
same. :func:`is_validation` decides the train/validation split from a stable hash of the
document name, so the split does not depend on order, machine or number of processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


class DataError(ValueError):
    """The corpus, tokenizer or sampling settings cannot be used. The message is fit to show a user."""


class Document(NamedTuple):
    """One document: a stable ``name`` (decides its split) and its ``text``."""

    name: str
    text: str


FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
TEXT_EXTENSIONS = frozenset(
    ".txt .text .md .markdown .rst .py .pyi .c .h .cc .cpp .hpp .cu .java .js .ts .go .rs .rb .lua .sh "
    ".html .htm .css .xml .json .yaml .yml .toml .ini .cfg .tex .csv .tsv .sql .org .adoc".split()
)
BINARY_EXTENSIONS = frozenset(
    ".pyc .pyo .so .o .a .dll .exe .bin .npy .npz .pt .safetensors .arrow .parquet .gz .bz2 .xz .zst .zip "
    ".tar .png .jpg .jpeg .gif .pdf .ico .whl .db .sqlite".split()
)
HF_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def hash_fraction(name: str) -> float:
    """A stable number in [0, 1) from a document name (BLAKE2b, independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def is_validation(name: str, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split: its name hashes below ``val_fraction``."""
    return hash_fraction(name) < val_fraction


def _walk(root: Path, suffixes: frozenset[str] | None = None) -> list[Path]:
    """Files under ``root``, recursively, sorted by relative path; hidden entries and package dirs skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS]
        for f in filenames:
            if not f.startswith(".") and (suffixes is None or Path(f).suffix.lower() in suffixes):
                found.append(Path(dirpath, f))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read corpus file {path}: {e.strerror or e}") from e


def _text_of_file(path: Path) -> str | None:
    """A file's text: known text extensions decode with errors="replace"; others only when they
    decode cleanly as UTF-8 and hold no NUL byte; known binary extensions are skipped."""
    suffix = path.suffix.lower()
    if suffix in BINARY_EXTENSIONS:
        return None
    raw = _read_bytes(path)
    if suffix in TEXT_EXTENSIONS:
        return raw.decode("utf-8", errors="replace")
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _field(row: object, field: str, where: str) -> str | None:
    if not isinstance(row, dict):
        raise DataError(f"{where} is not a JSON object")
    if field not in row:
        raise DataError(f"{where} has no field {field!r} (fields: {', '.join(map(str, row)) or 'none'}); "
                        "set data.text_field")
    value = row[field]
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is a {type(value).__name__}, not text")
    try:
        (value or "").encode("utf-8")
    except UnicodeEncodeError:  # JSON "\ud800" escapes give lone surrogates; replace them
        value = value.encode("utf-8", errors="replace").decode("utf-8")
    return value


@dataclass(frozen=True)
class Source:
    """A resolved corpus: ``kind`` is "stdlib", "text", "jsonl", "parquet" or "hf"; ``root`` a file or directory."""

    kind: str
    root: Path
    text_field: str = "text"
    max_bytes: int = 0

    def describe(self) -> str:
        """One line naming the corpus, for logs and ``meta.json``."""
        if self.kind == "stdlib":
            return f"Python {sys.version.split()[0]} standard library ({self.root})"
        field = f", field {self.text_field!r}" if self.kind in ("jsonl", "parquet", "hf") else ""
        limit = f", first {self.max_bytes} bytes" if self.max_bytes else ""
        return f"{self.kind} corpus {self.root}{field}{limit}"

    def fingerprint(self) -> str:
        """A hash of everything that determines the documents: for stdlib the Python version and path,
        otherwise every file's relative path, size and modification time, plus field and byte limit."""
        h = hashlib.sha256(json.dumps([self.kind, str(self.root), self.text_field, self.max_bytes]).encode())
        if self.kind == "stdlib":
            h.update(f"{sys.implementation.name}-{sys.version}".encode())
        else:
            files = [self.root] if self.root.is_file() else _walk(self.root)
            for f in files:
                try:
                    st = f.stat()
                except OSError as e:
                    raise DataError(f"cannot read corpus file {f}: {e.strerror or e}") from e
                h.update(f"{f.relative_to(self.root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def documents(self) -> Iterator[Document]:
        """Yield the non-empty documents in a fixed order, honouring ``max_bytes`` (UTF-8 bytes of text;
        the last document is cut to fit). Raises DataError for an empty corpus or an unreadable file."""
        remaining = self.max_bytes or None
        count = 0
        for doc in self._raw_documents():
            if not doc.text:
                continue
            if remaining is not None:
                raw = doc.text.encode("utf-8", "surrogatepass")
                if len(raw) >= remaining:
                    doc = Document(doc.name, raw[:remaining].decode("utf-8", errors="ignore"))
                remaining -= len(raw)
            if doc.text:
                count += 1
                yield doc
            if remaining is not None and remaining <= 0:
                break
        if count == 0:
            raise DataError(f"the corpus has no text: {self.describe()}")

    def _raw_documents(self) -> Iterator[Document]:
        if self.kind == "stdlib":
            for path in _walk(self.root, frozenset({".py"})):
                yield Document(path.relative_to(self.root).as_posix(), _read_bytes(path).decode("utf-8", "replace"))
        elif self.kind == "text":
            files = [self.root] if self.root.is_file() else _walk(self.root)
            for path in files:
                text = _text_of_file(path) if self.root.is_dir() else _read_bytes(path).decode("utf-8", "replace")
                if text is not None:
                    yield Document(self._name(path), text)
        elif self.kind == "jsonl":
            for path in self._files(frozenset({".jsonl", ".ndjson"})):
                yield from self._jsonl(path)
        elif self.kind == "parquet":
            for path in self._files(frozenset({".parquet"})):
                yield from self._parquet(path)
        else:
            yield from self._hf()

    def _name(self, path: Path) -> str:
        return path.name if self.root.is_file() else path.relative_to(self.root).as_posix()

    def _files(self, suffixes: frozenset[str]) -> list[Path]:
        if self.root.is_file():
            return [self.root]
        files = _walk(self.root, suffixes)
        if not files:
            raise DataError(f"no {'/'.join(sorted(suffixes))} files in {self.root}")
        return files

    def _jsonl(self, path: Path) -> Iterator[Document]:
        name = self._name(path)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"line {lineno} of {path}"
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{where} is not valid JSON: {e.msg} column {e.colno}") from e
                    yield Document(f"{name}:{lineno}", _field(row, self.text_field, where) or "")
        except OSError as e:
            raise DataError(f"cannot read corpus file {path}: {e.strerror or e}") from e

    def _parquet(self, path: Path) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"cannot read Parquet file {path}: {e}") from e
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise DataError(f"{path} has no column {self.text_field!r} (columns: {', '.join(names)}); "
                            "set data.text_field")
        kind = pf.schema_arrow.field(self.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{path}: column {self.text_field!r} has type {kind}, not string")
        row, name = 0, self._name(path)
        for batch in pf.iter_batches(batch_size=1024, columns=[self.text_field]):
            for text in batch.column(0).to_pylist():
                yield Document(f"{name}:{row}", text or "")
                row += 1

    def _hf(self) -> Iterator[Document]:
        try:
            import datasets
        except ImportError as e:
            raise DataError("reading a Hugging Face dataset needs the 'datasets' package: "
                            "pip install 'shardwise[hf]'") from e
        ds = datasets.load_from_disk(str(self.root))
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            ds = ds[split]
        if self.text_field not in ds.column_names:
            raise DataError(f"dataset {self.root} has no column {self.text_field!r} "
                            f"(columns: {', '.join(ds.column_names)}); set data.text_field")
        row = 0
        for batch in ds.select_columns([self.text_field]).iter(batch_size=1024):
            for text in batch[self.text_field]:
                if text is not None and not isinstance(text, str):
                    raise DataError(f"dataset {self.root}: column {self.text_field!r} holds "
                                    f"{type(text).__name__}, not text")
                yield Document(f"hf:{row}", text or "")
                row += 1


def _detect_dir_format(root: Path) -> str:
    if any((root / m).is_file() for m in HF_MARKERS):
        return "hf"
    suffixes = {p.suffix.lower() for p in _walk(root)}
    if ".parquet" in suffixes and not suffixes & TEXT_EXTENSIONS:
        return "parquet"
    if suffixes and suffixes <= {".jsonl", ".ndjson"}:
        return "jsonl"
    return "text"


def open_source(source: str, format: str = "auto", text_field: str = "text", max_bytes: int = 0) -> Source:
    """Resolve ``data.source`` / ``data.format`` to a :class:`Source` (format "auto" picks by extension,
    or for a directory by its content: a ``dataset_info.json`` marks a Hugging Face dataset)."""
    if format not in FORMATS:
        raise DataError(f"data.format={format!r} is not valid; use one of {', '.join(map(repr, FORMATS))}")
    if max_bytes < 0:
        raise DataError(f"data.max_bytes={max_bytes} must be >= 0 (0 = all)")
    if source == "stdlib":
        return Source("stdlib", stdlib_dir(), text_field, max_bytes)
    root = Path(source).expanduser()
    if not root.exists():
        raise DataError(f"data.source={source!r} does not exist; give a file or directory, or 'stdlib'")
    root = root.resolve()
    if format == "auto":
        if root.is_dir():
            format = _detect_dir_format(root)
        else:
            format = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}.get(root.suffix.lower(), "text")
    if format == "hf" and not root.is_dir():
        raise DataError(f"data.source={source!r}: a Hugging Face dataset is a directory written by save_to_disk")
    return Source(format, root, text_field, max_bytes)
