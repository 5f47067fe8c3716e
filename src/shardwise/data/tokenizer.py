"""Tokenizers behind one small interface: ``encode``, ``encode_batch``, ``decode``, ``vocab_size``,
``eos_id``, ``save``, plus ``encode_docs`` (documents concatenated, each followed by end-of-text)
which the token cache uses.

- :class:`ByteTokenizer`: UTF-8 bytes 0..255 and end-of-text 256; nothing to train or save.
- :class:`BPETokenizer`: byte-level byte-pair encoding (Sennrich et al., 2016, "Neural Machine
  Translation of Rare Words with Subword Units"; byte-level variant as in GPT-2, Radford et al.,
  2019) trained and run by the Hugging Face ``tokenizers`` library, stored as ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import tomllib

from shardwise.data.sources import DataError

EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>")
TOKENIZER_FILE = "tokenizer.json"
_PIECE_CHARS = 1 << 20  # BPE encodes long documents in pieces of about this many characters


def _as_int_array(ids) -> np.ndarray:
    if hasattr(ids, "detach"):  # a torch tensor
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 and end-of-text as 256 (vocab_size 257). Needs no training."""

    spec = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_docs(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ``texts`` as one uint16 array, each followed by eos; and each document's token count."""
        raws = [t.encode("utf-8", errors="replace") for t in texts]
        lengths = np.fromiter((len(r) + 1 for r in raws), dtype=np.int64, count=len(raws))
        out = np.full(int(lengths.sum()), self.eos_id, dtype=np.uint16)
        is_byte = np.ones(len(out), dtype=bool)
        is_byte[np.cumsum(lengths) - 1] = False
        out[is_byte] = np.frombuffer(b"".join(raws), dtype=np.uint8)
        return out, lengths

    def decode(self, ids) -> str:
        """Bytes back to text; ids >= 256 (end-of-text) are dropped, invalid UTF-8 becomes U+FFFD."""
        arr = _as_int_array(ids)
        return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path | None:
        """Nothing to save: a run directory without ``tokenizer.json`` means the byte tokenizer."""
        return None

    @property
    def sha256(self) -> str:
        return "byte"


def _pieces(text: str, limit: int = _PIECE_CHARS) -> list[str]:
    """Cut a long text into pieces of at most ``limit`` characters, at line ends where possible."""
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit) + 1
        cut = cut if cut > start else start + limit
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` (byte-level BPE when trained here, or any loaded tokenizer.json)."""

    def __init__(self, tokenizer, spec: str = "bpe"):
        self.tokenizer = tokenizer
        self.spec = spec
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        for token in EOS_CANDIDATES:
            eos = tokenizer.token_to_id(token)
            if eos is not None:
                self.eos_id = eos
                break
        else:
            raise DataError(f"tokenizer {spec} has no end-of-text token; add one of {', '.join(EOS_CANDIDATES)}")
        self._batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train byte-level BPE with ``vocab_size`` entries (including ``<|endoftext|>``) on ``texts``."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator((p for t in texts for p in _pieces(t)), trainer=trainer)
        return cls(tok, spec="bpe")

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a ``tokenizer.json``; end-of-text is the first of EOS_CANDIDATES it holds."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"cannot load tokenizer {path}: {e}") from e
        return cls(tok, spec=str(path))

    @property
    def sha256(self) -> str:
        """Hash of the serialized tokenizer: its identity in cache keys."""
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._batch(list(texts), add_special_tokens=False)]

    def encode_docs(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ``texts`` as one uint32 array, each followed by eos; and each document's token count.
        Long documents are encoded in line-aligned pieces so the batch stays parallel and bounded."""
        owner, pieces = [], []
        for i, text in enumerate(texts):
            for piece in _pieces(text):
                owner.append(i)
                pieces.append(piece)
        lengths = np.ones(len(texts), dtype=np.int64)  # the eos of each document
        flat: list[int] = []
        for j, ids in enumerate(self.encode_batch(pieces)):
            flat.extend(ids)
            lengths[owner[j]] += len(ids)
            if j + 1 == len(owner) or owner[j + 1] != owner[j]:
                flat.append(self.eos_id)
        return np.array(flat, dtype=np.uint32), lengths

    def decode(self, ids) -> str:
        """Token ids back to text; special tokens (end-of-text) are dropped."""
        return self.tokenizer.decode(_as_int_array(ids).tolist(), skip_special_tokens=True)

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/tokenizer.json`` atomically (safe when several processes save at once)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tokenizer.", suffix=".json")
        os.close(fd)
        try:
            self.tokenizer.save(tmp)
            os.replace(tmp, directory / TOKENIZER_FILE)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return directory / TOKENIZER_FILE


Tokenizer = ByteTokenizer | BPETokenizer


def load_tokenizer(spec: str, run_dir: str | Path | None = None) -> Tokenizer:
    """``"byte"``, a path to a ``tokenizer.json``, or ``"bpe"`` (the one trained for a run: needs ``run_dir``)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if run_dir is not None and (Path(run_dir) / TOKENIZER_FILE).is_file():
            return BPETokenizer.from_file(Path(run_dir) / TOKENIZER_FILE)
        raise DataError("the 'bpe' tokenizer is trained by prepare_corpus; give the run directory that holds "
                        "its tokenizer.json, or a path to a tokenizer.json")
    return BPETokenizer.from_file(Path(spec).expanduser())


def tokenizer_from_run(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a run used: ``run_dir/tokenizer.json`` when present, else the byte tokenizer
    (unless the run's ``config.toml`` names another tokenizer, which is an error: the file is missing)."""
    run_dir = Path(run_dir)
    if (run_dir / TOKENIZER_FILE).is_file():
        return BPETokenizer.from_file(run_dir / TOKENIZER_FILE)
    config = run_dir / "config.toml"
    if config.is_file():
        try:
            spec = tomllib.loads(config.read_text()).get("data", {}).get("tokenizer", "byte")
        except (OSError, tomllib.TOMLDecodeError):
            spec = "byte"
        if spec != "byte":
            raise DataError(f"run {run_dir} used tokenizer {spec!r} but holds no {TOKENIZER_FILE}")
    return ByteTokenizer()
