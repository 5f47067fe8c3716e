"""``shardwise export RUN_DIR --format hf OUT_DIR``: a run's newest valid checkpoint as a directory
``transformers`` loads (``AutoModelForCausalLM`` / ``GPT2LMHeadModel`` / ``LlamaForCausalLM``,
``AutoTokenizer``).

The directory holds ``config.json``, ``model.safetensors`` (fp32, the single-process weights under the
``transformers`` names) and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``; the byte tokenizer is written as a byte-level BPE with no merges whose
ids are the byte values). It is written under a temporary name beside ``OUT_DIR`` and renamed into
place, as checkpoints are (rename(2)), so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardwise.hf.config_map import hf_config
from shardwise.hf.weights import to_hf


def export_run(run_dir: Path, out_dir: Path, checkpoint: Path | None = None) -> Path:
    """Write the run's model (newest valid checkpoint, or ``checkpoint``) and tokenizer to ``out_dir``."""
    from shardwise.data import tokenizer_from_run
    from shardwise.generate_run import load_trained_model

    model, cfg = load_trained_model(Path(run_dir), checkpoint)
    tokenizer = tokenizer_from_run(run_dir)
    return export_model(model.state_dict(), cfg.model, tokenizer, Path(out_dir))


def export_model(state: dict[str, torch.Tensor], m, tokenizer, out_dir: Path) -> Path:
    """Atomically write ``state`` (our model state with fields ``m``) and ``tokenizer`` to ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory; choose a new OUT_DIR")
    config = hf_config(m, eos_id=tokenizer.eos_id)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in to_hf(state, m).items()}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".tmp-{out_dir.name}-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        write_tokenizer(tokenizer, tmp)
        for path in tmp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_tokenizer(tokenizer, directory: Path) -> None:
    """``tokenizer.json`` (``tokenizers`` format) plus the two small files ``AutoTokenizer`` reads."""
    from shardwise.data.tokenizer import EOS_TOKEN

    if tokenizer.spec == "byte":
        tok, eos = byte_level_tokenizer(), EOS_TOKEN
    else:
        tok, eos = tokenizer.tokenizer, tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json",
                {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos,
                 "unk_token": None, "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False})
    _write_json(directory / "special_tokens_map.json", {"eos_token": eos, "bos_token": eos})


def byte_level_tokenizer():
    """Our byte tokenizer (ids 0..255 = UTF-8 bytes, 256 = end-of-text) as a ``tokenizers.Tokenizer``:
    a byte-level BPE (GPT-2's byte-to-unicode alphabet, Radford et al. 2019 §2.2) with no merges and
    each byte's symbol at the byte's own id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from shardwise.data.tokenizer import EOS_TOKEN

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab[EOS_TOKEN] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (openai/gpt-2, encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
