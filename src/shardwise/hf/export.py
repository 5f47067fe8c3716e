"""``shardwise export RUN_DIR --format hf OUT_DIR [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]``: a run's newest
valid checkpoint as a directory ``transformers`` loads (``AutoModelForCausalLM`` / ``GPT2LMHeadModel`` /
``LlamaForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM``, ``AutoTokenizer``).

The directory holds ``config.json``, the weights under the ``transformers`` names in Hub-style shards
(:mod:`shardwise.hf.shards`: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` of at most
``--max-shard-size`` bytes with ``model.safetensors.index.json``) in the run's parameter dtype unless ``--dtype``
says otherwise (bf16 for a bf16 run, fp16 for an fp16 one, else fp32), and the tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``; the byte tokenizer is written as a byte-level BPE with
no merges whose ids are the byte values).

The export streams: it reads the layout-free checkpoint one tensor (or one expert's rows) at a time through
safetensors slices, assembles one ``transformers`` tensor, writes it and drops it, so it never holds more
than about one tensor of the model (:func:`export_state`). It is written under a temporary name beside
``OUT_DIR`` and renamed into place, as checkpoints are (rename(2)), so a failed export leaves nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from shardwise.hf.config_map import hf_config
from shardwise.hf.shards import (
    INDEX_FILE,
    dtype_of,
    nbytes,
    parse_size,
    plan_shards,
    shard_names,
    write_index,
    write_streamed,
)
from shardwise.hf.weights import assemble, hf_layout

DEFAULT_SHARD_SIZE = "5GB"
"""The Hub's (and ``save_pretrained``'s) default largest shard."""
RUN_DTYPES = {"bf16": "bf16", "fp16": "fp16"}
"""train.precision -> the default export dtype (fp32 otherwise)."""


def export_run(run_dir: Path, out_dir: Path, checkpoint: Path | None = None, dtype: str | None = None,
               max_shard_size: str | int = DEFAULT_SHARD_SIZE) -> Path:
    """Write the run's model (newest valid checkpoint, or ``checkpoint``) and tokenizer to ``out_dir``."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.data import tokenizer_from_run
    from shardwise.train.checkpoint import latest_valid_checkpoint, verify_checkpoint
    from shardwise.train.state import open_checkpoint

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.toml)")
    cfg = resolve(Config.load(run_dir / "config.toml"))  # the saved layout; only the model section is used here
    dtype = dtype or RUN_DTYPES.get(cfg.train.precision, "fp32")
    dtype_of(dtype), parse_size(max_shard_size)  # bad input fails before anything is read
    path = checkpoint or latest_valid_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise FileNotFoundError(f"{run_dir} has no valid checkpoint under checkpoints/")
    verify_checkpoint(path)
    reader = open_checkpoint(path)
    return export_state(reader.model_state(), cfg.model, tokenizer_from_run(run_dir), Path(out_dir), dtype,
                        max_shard_size, release=getattr(reader, "close", None))


def export_model(state: Mapping[str, torch.Tensor], m, tokenizer, out_dir: Path, dtype: str = "fp32",
                 max_shard_size: str | int = DEFAULT_SHARD_SIZE) -> Path:
    """Atomically write ``state`` (our model state with fields ``m``) and ``tokenizer`` to ``out_dir``."""
    return export_state(state, m, tokenizer, Path(out_dir), dtype, max_shard_size)


def export_state(state: Mapping[str, torch.Tensor], m, tokenizer, out_dir: Path, dtype: str,
                 max_shard_size: str | int, release=None) -> Path:
    """Write our model state ``state`` (a dict, or a checkpoint's lazy state with ``read_slice``) as shards of at
    most ``max_shard_size`` bytes in ``dtype``, one tensor in memory at a time; ``release()`` runs after each
    tensor (a checkpoint reader closes its files)."""
    from shardwise.model import Transformer

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory; choose a new OUT_DIR")
    torch_dtype, max_bytes = dtype_of(dtype), parse_size(max_shard_size)
    config = hf_config(m, eos_id=tokenizer.eos_id, dtype=str(torch_dtype).removeprefix("torch."))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(m).state_dict().items()}
    layout = hf_layout(m, shapes)
    sizes = {name: nbytes(t.shape, torch_dtype) for name, t in layout.items()}
    shards = plan_shards(sizes, max_bytes)
    files = shard_names(len(shards))

    def ours(key: str, row: int | None) -> torch.Tensor:
        if row is None:
            return state[key]
        if hasattr(state, "read_slice"):  # one expert's rows of a stacked tensor, read alone
            inner = math.prod(shapes[key][1:])
            return state.read_slice(key, row * inner, (row + 1) * inner).view(shapes[key][1:])
        return state[key][row]

    def produce(name: str) -> torch.Tensor:
        t = assemble(layout[name], ours, torch_dtype)
        if release is not None:
            release()
        return t

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".tmp-{out_dir.name}-"))
    try:
        for file, names in zip(files, shards, strict=True):
            write_streamed(tmp / file, [(n, layout[n].shape, torch_dtype) for n in names], produce)
        if len(files) > 1:
            write_index(tmp / INDEX_FILE, {n: f for f, names in zip(files, shards, strict=True) for n in names},
                        sum(sizes.values()))
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
