"""Read a ``transformers`` directory (config.json + safetensors) as our single-process model state.

Weights are read with safetensors only (``model.safetensors``, or the shards listed in
``model.safetensors.index.json``); pickled ``pytorch_model.bin`` files are refused rather than unpickled.
Every tensor's shape is checked against what ``config.json`` implies before anything is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.hf.config_map import HFError, model_fields, read_hf_config
from shardwise.hf.lazy import HFFiles, LazyHFState
from shardwise.hf.recipes import recipes
from shardwise.hf.shards import INDEX_FILE, SINGLE_FILE
from shardwise.hf.weights import check_shapes, normalize_name


def weight_files(directory: Path) -> list[Path]:
    directory = Path(directory)
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    if (directory / INDEX_FILE).is_file():
        index = json.loads((directory / INDEX_FILE).read_text())
        names = sorted(set(index["weight_map"].values()))
        for name in names:  # a plain file name inside the directory, never a path that leads out of it
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
                raise HFError(f"{directory / INDEX_FILE}: weight_map names {name!r}, not a file name inside "
                              f"{directory}")
        return [directory / name for name in names]
    found = "pytorch_model.bin" if (directory / "pytorch_model.bin").exists() else "none"
    raise HFError(f"{directory} holds no {SINGLE_FILE} or {INDEX_FILE} (found: {found}); pickled weights are not "
                  "read: convert them with transformers' save_pretrained(..., safe_serialization=True)")


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers (no data is read)."""
    shapes = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_directory(directory: Path, m) -> None:
    """HFError unless ``directory``'s weights are those of a model with fields ``m`` (headers only: cheap enough
    to run when the config is validated, before any worker starts)."""
    check_model_fields(directory, m)
    check_shapes(tensor_shapes(directory), m, str(directory))


def check_model_fields(directory: Path, m) -> None:
    """HFError when the resolved model fields ``m`` differ from the directory's config.json, or when its weights
    are quantized (a plan reads such a config.json; training needs the weights themselves)."""
    hf = read_hf_config(directory)
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise HFError(f"{directory}/config.json: quantization_config.quant_method={quant!r}: quantized weights are "
                      "not read; convert the checkpoint to bf16 or fp32 first (e.g. DeepSeek's fp8_cast_bf16.py)")
    fields = model_fields(hf, f"{directory}/config.json")
    for key, value in fields.items():
        if getattr(m, key) != value:
            raise HFError(f"model.{key}={getattr(m, key)!r} but {directory}/config.json gives {value!r}")


def lazy_hf_state(directory: Path, m, dtype: torch.dtype = torch.float32) -> LazyHFState:
    """Our model state (keys of ``Transformer(m).state_dict()``, ``dtype``) of a transformers directory whose
    config.json has the fields ``m``, read slice by slice on demand (:class:`~shardwise.hf.lazy.LazyHFState`);
    HFError naming the tensor and both shapes on a mismatch (headers only)."""
    directory = Path(directory)
    check_model_fields(directory, m)
    files = HFFiles(weight_files(directory), lambda name: normalize_name(name, m))
    check_shapes(files.shapes, m, str(directory))
    return LazyHFState(files, recipes(m, files.shapes.keys()), dtype)


def load_hf_state(directory: Path, m, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """:func:`lazy_hf_state`, every tensor read (for tests and tools; a run reads its slices only)."""
    state = lazy_hf_state(directory, m, dtype)
    return {k: state[k] for k in state}
