"""The token cache: a corpus tokenized once into flat arrays, read back by memory-mapping
(:class:`shardwise.data.sampler.TokenWindows`).

``prepare_corpus(data_cfg)`` writes, under ``<cache_dir or ~/.cache/shardwise>/tokens/<key>/``:

- ``train.bin``, ``val.bin``: little-endian uint16 (vocabulary <= 65536) or uint32 token ids, the
  documents of each split concatenated, each followed by end-of-text;
- ``meta.json``: dtype, token and document counts, vocabulary, eos id, tokenizer, source;
- ``tokenizer.json`` for a BPE or loaded tokenizer.

``key`` hashes everything that determines the content (source fingerprint, format, field, byte
limit, validation fraction, tokenizer identity), so a changed input gets a new cache and an
unchanged one is found at once. The directory is built next to its target and published with one
``os.rename``, under a file lock where the OS has ``fcntl``: concurrent callers (every rank under
torchrun) build it once, and a reader never sees a half-written cache. A trained BPE tokenizer is
cached the same way under ``tokenizers/<key>/`` so a second run does not retrain.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardwise.data.sources import DataError, Document, Source, hash_fraction, open_source
from shardwise.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

CACHE_VERSION = 1
META_FILE = "meta.json"
_BATCH_CHARS = 4 << 20  # tokenize this many characters of text at a time
_BATCH_DOCS = 4096


@dataclass(frozen=True)
class CorpusInfo:
    """Where a prepared corpus lives and what it holds; ``tokenizer_spec`` is "byte" or a tokenizer.json path."""

    train_path: Path
    val_path: Path
    vocab_size: int
    eos_id: int
    tokenizer_spec: str
    n_train_tokens: int
    n_val_tokens: int
    cache_dir: Path
    dtype: str = "<u2"
    source: str = ""

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_spec)


def cache_root(cache_dir: str | Path = "") -> Path:
    """``cache_dir``, or ``~/.cache/shardwise`` when empty."""
    return Path(cache_dir).expanduser() if str(cache_dir) else Path.home() / ".cache" / "shardwise"


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts], default=str).encode()).hexdigest()[:24]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (no-op where ``fcntl`` is missing: rename stays atomic).

    The lock file stays beside what it guarded once that was built; when the build failed (a source that
    cannot be read) it is removed, still under the lock, so a failed source leaves nothing in the cache. A
    process that was waiting then holds the removed file's lock and builds as well: harmless, since every
    build lands by an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_meta(directory: str | Path) -> dict:
    """The ``meta.json`` of a token cache directory."""
    try:
        return json.loads((Path(directory) / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{directory} is not a token cache (no readable {META_FILE})") from e


def _complete(directory: Path) -> dict | None:
    """The meta of a finished, consistent cache directory, else None."""
    try:
        meta = read_meta(directory)
        size = np.dtype(meta["dtype"]).itemsize
        ok = all((directory / f"{s}.bin").stat().st_size == meta[f"n_{s}_tokens"] * size for s in ("train", "val"))
    except (DataError, OSError, KeyError, TypeError):
        return None
    return meta if ok else None


def _bpe_tokenizer(source: Source, fingerprint: str, vocab_size: int, val_fraction: float, root: Path) -> BPETokenizer:
    """Train byte-level BPE on the training documents, or load the one trained before on this corpus."""
    import tokenizers

    key = _key("bpe", fingerprint, val_fraction, vocab_size, tokenizers.__version__)
    directory = root / "tokenizers" / key
    if not (directory / TOKENIZER_FILE).is_file():
        with _locked(root / "tokenizers" / f"{key}.lock"):
            if not (directory / TOKENIZER_FILE).is_file():
                log.info("training a %d-entry BPE tokenizer on %s", vocab_size, source.describe())
                t0 = time.perf_counter()
                BPETokenizer.train(_training_texts(source, val_fraction), vocab_size).save(directory)
                log.info("trained the BPE tokenizer in %.1f s", time.perf_counter() - t0)
    return BPETokenizer.from_file(directory / TOKENIZER_FILE)


def _training_texts(source: Source, val_fraction: float) -> Iterator[str]:
    """The texts of the training documents (or, when every document is held out, the first one)."""
    n, first_held = 0, None
    for doc in source.documents():
        if hash_fraction(doc.name) >= val_fraction:
            n += 1
            yield doc.text
        elif first_held is None:
            first_held = doc.text
    if n == 0 and first_held is not None:
        yield first_held


@dataclass
class _Split:
    """One output file being written, and the document that would move if the other split is empty."""

    path: Path
    dtype: np.dtype
    n_tokens: int = 0
    n_docs: int = 0
    mover: tuple[float, int, int] | None = None  # (hash, start, length)
    prefer_low: bool = True
    file: object = field(default=None, repr=False)

    def write(self, tokens: np.ndarray, lengths: np.ndarray, fracs: list[float]) -> None:
        tokens.astype(self.dtype, copy=False).tofile(self.file)
        starts = self.n_tokens + np.cumsum(lengths) - lengths
        for frac, start, length in zip(fracs, starts.tolist(), lengths.tolist(), strict=True):
            if self.mover is None or (frac < self.mover[0]) == self.prefer_low:
                self.mover = (frac, start, length)
        self.n_tokens += len(tokens)
        self.n_docs += len(lengths)


def _write_batch(docs: list[Document], tok: Tokenizer, val_fraction: float, train: _Split, val: _Split) -> None:
    fracs = [hash_fraction(d.name) for d in docs]
    tokens, lengths = tok.encode_docs([d.text for d in docs])
    is_val = np.array([f < val_fraction for f in fracs], dtype=bool)
    per_token = np.repeat(is_val, lengths)
    for split, mask, sel in ((train, ~is_val, ~per_token), (val, is_val, per_token)):
        if mask.any():
            split.write(tokens[sel], lengths[mask], [f for f, m in zip(fracs, mask, strict=True) if m])


def _write_parts(parts: dict[Path, list[np.ndarray]]) -> None:
    """Write each ``path.with_suffix(".new")`` as the concatenation of its arrays."""
    for path, pieces in parts.items():
        with open(path.with_suffix(".new"), "wb") as f:
            for piece in pieces:
                piece.tofile(f)


def _ensure_both_splits(train: _Split, val: _Split, val_fraction: float) -> None:
    """Guarantee a non-empty split on each side: with one document, its tail (``val_fraction`` of its
    tokens) becomes validation; with several but one side empty, the document whose hash lies nearest
    the threshold moves across."""
    if train.n_docs and val.n_docs:
        return
    full, empty = (train, val) if train.n_docs else (val, train)
    src = np.memmap(full.path, dtype=full.dtype, mode="r")
    if full.n_docs == 1:
        n_val = min(len(src) - 1, max(1, round(len(src) * val_fraction)))
        parts = {train.path: [src[: len(src) - n_val]], val.path: [src[len(src) - n_val :]]}
    else:
        _, start, length = full.mover
        parts = {full.path: [src[:start], src[start + length :]], empty.path: [src[start : start + length]]}
    _write_parts(parts)
    del parts, src  # release the mapping before replacing the file under it
    for path in (train.path, val.path):
        if path.with_suffix(".new").exists():
            os.replace(path.with_suffix(".new"), path)


def _build(source: Source, tok: Tokenizer, val_fraction: float, target: Path, tokenizer_source: str) -> None:
    """Tokenize ``source`` into a temporary directory next to ``target``, then rename it into place."""
    dtype = np.dtype("<u2" if tok.vocab_size <= 1 << 16 else "<u4")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published cache is readable like any file
    log.info("tokenizing %s into %s", source.describe(), target)
    t0 = time.perf_counter()
    try:
        train = _Split(tmp / "train.bin", dtype, prefer_low=True)
        val = _Split(tmp / "val.bin", dtype, prefer_low=False)
        n_chars = 0
        with open(train.path, "wb") as train.file, open(val.path, "wb") as val.file:
            batch, chars = [], 0
            for doc in source.documents():
                batch.append(doc)
                chars += len(doc.text)
                if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
                    _write_batch(batch, tok, val_fraction, train, val)
                    n_chars, batch, chars = n_chars + chars, [], 0
            if batch:
                _write_batch(batch, tok, val_fraction, train, val)
                n_chars += chars
        train.file = val.file = None
        _ensure_both_splits(train, val, val_fraction)
        if isinstance(tok, BPETokenizer):
            tok.save(tmp)
        meta = {
            "version": CACHE_VERSION,
            "dtype": dtype.str,
            "n_train_tokens": (tmp / "train.bin").stat().st_size // dtype.itemsize,
            "n_val_tokens": (tmp / "val.bin").stat().st_size // dtype.itemsize,
            "n_docs": train.n_docs + val.n_docs,
            "n_chars": n_chars,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "tokenizer": "byte" if isinstance(tok, ByteTokenizer) else TOKENIZER_FILE,
            "tokenizer_source": tokenizer_source,
            "source": source.describe(),
            "val_fraction": val_fraction,
            "max_bytes": source.max_bytes,
            "build_seconds": round(time.perf_counter() - t0, 3),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if _complete(target) is None:  # not a concurrent builder's finished copy: a real failure
                raise
        log.info("tokenized %d documents into %d + %d tokens in %.1f s", meta["n_docs"],
                 meta["n_train_tokens"], meta["n_val_tokens"], meta["build_seconds"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _info(directory: Path, meta: dict) -> CorpusInfo:
    spec = "byte" if meta["tokenizer"] == "byte" else str(directory / TOKENIZER_FILE)
    return CorpusInfo(
        train_path=directory / "train.bin",
        val_path=directory / "val.bin",
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        tokenizer_spec=spec,
        n_train_tokens=meta["n_train_tokens"],
        n_val_tokens=meta["n_val_tokens"],
        cache_dir=directory,
        dtype=meta["dtype"],
        source=meta["source"],
    )


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_file() and dst.read_bytes() == src.read_bytes():
        return
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prepare_corpus(cfg, run_dir: str | Path | None = None) -> CorpusInfo:
    """Tokenize the corpus that ``cfg`` (a :class:`shardwise.config.DataConfig`) describes, or find it
    in the cache; safe to call from several processes at once. With ``run_dir``, a BPE or loaded
    tokenizer is copied to ``run_dir/tokenizer.json`` (where :func:`tokenizer_from_run` looks)."""
    if not 0.0 < cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in (0, 1)")
    source = open_source(cfg.source, cfg.format, cfg.text_field, cfg.max_bytes)
    root = cache_root(cfg.cache_dir)
    fingerprint = source.fingerprint()
    if cfg.tokenizer == "byte":
        tok: Tokenizer = ByteTokenizer()
    elif cfg.tokenizer == "bpe":
        tok = _bpe_tokenizer(source, fingerprint, cfg.bpe_vocab_size, cfg.val_fraction, root)
    else:
        tok = load_tokenizer(cfg.tokenizer)
    key = _key("tokens", fingerprint, cfg.val_fraction, tok.sha256)
    target = root / "tokens" / key
    meta = _complete(target)
    if meta is None:
        with _locked(root / "tokens" / f"{key}.lock"):
            meta = _complete(target)
            if meta is None:
                if target.exists():  # a damaged cache (e.g. files removed by hand): rebuild it
                    shutil.rmtree(target)
                _build(source, tok, cfg.val_fraction, target, cfg.tokenizer)
                meta = _complete(target)
                if meta is None:
                    raise DataError(f"token cache {target} was not written completely")
    info = _info(target, meta)
    if run_dir is not None and info.tokenizer_spec != "byte":
        _copy_atomic(Path(info.tokenizer_spec), Path(run_dir) / TOKENIZER_FILE)
    elif run_dir is not None:  # a byte run: no stale tokenizer.json may mislead tokenizer_from_run
        (Path(run_dir) / TOKENIZER_FILE).unlink(missing_ok=True)
    return info
