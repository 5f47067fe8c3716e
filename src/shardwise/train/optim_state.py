"""Optimizer state as safetensors-ready tensors plus JSON metadata (no pickle).

``torch.optim`` state dicts mix tensors (moments, AdamW's ``step``) with Python values
(hyper-parameters, tuples such as ``betas``); checkpoints store the first in safetensors files
and the second in JSON, and this module converts both ways exactly.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from shardwise.train.checkpoint import CheckpointError


def optimizer_state_to_tensors(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten a ``torch.optim.Optimizer.state_dict()`` into tensors plus JSON metadata.

    Tensors are named by their path, e.g. ``state.3.exp_avg`` or ``state.3.step`` (AdamW keeps
    ``step`` as a tensor); everything else (hyper-parameters, Python numbers, tuples such as
    ``betas``) goes into the JSON metadata. :func:`optimizer_state_from_tensors` is the exact
    inverse, suitable for ``optimizer.load_state_dict``.
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise TypeError("expected an optimizer state_dict with 'state' and 'param_groups'")
    tensors: dict[str, torch.Tensor] = {}
    state_meta = []
    for key, pstate in state_dict["state"].items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"optimizer state key {key!r} is neither int nor str")
        if not isinstance(pstate, Mapping):
            raise TypeError(f"optimizer state[{key!r}] is a {type(pstate).__name__}, not a dict")
        values = {str(name): _encode(value, f"state.{key}.{name}", tensors) for name, value in pstate.items()}
        state_meta.append({"key": key, "values": values})
    groups = [_encode(dict(g), f"param_groups.{i}", tensors) for i, g in enumerate(state_dict["param_groups"])]
    extra = {k: _encode(v, k, tensors) for k, v in state_dict.items() if k not in ("state", "param_groups")}
    return tensors, {"state": state_meta, "param_groups": groups, "extra": extra}


def optimizer_state_from_tensors(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the optimizer ``state_dict`` flattened by :func:`optimizer_state_to_tensors`."""
    if (
        not isinstance(meta, Mapping)
        or not isinstance(meta.get("state"), list)
        or not isinstance(meta.get("param_groups"), list)
    ):
        raise CheckpointError("optimizer metadata is malformed: expected 'state' and 'param_groups' lists")
    state: dict[Any, dict[str, Any]] = {}
    for entry in meta["state"]:
        if not isinstance(entry, Mapping) or "key" not in entry or not isinstance(entry.get("values"), Mapping):
            raise CheckpointError(f"optimizer metadata has a malformed state entry: {entry!r}")
        state[entry["key"]] = {name: _decode(v, tensors) for name, v in entry["values"].items()}
    groups = [_decode(g, tensors) for g in meta["param_groups"]]
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    for k, v in (meta.get("extra") or {}).items():
        out[k] = _decode(v, tensors)
    return out


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-encode ``value``; tensors are moved into ``tensors`` and replaced by a reference."""
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise ValueError(f"optimizer state tensor name {path!r} is ambiguous")
        tensors[path] = value
        return {"__tensor__": path}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"optimizer state at {path} has non-string dict keys; cannot store as JSON")
        if "__tensor__" in value or "__tuple__" in value:
            raise ValueError(f"optimizer state at {path} uses a reserved key")
        return {k: _encode(v, f"{path}.{k}", tensors) for k, v in value.items()}
    raise TypeError(f"optimizer state at {path} has unsupported type {type(value).__name__}")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            name = value["__tensor__"]
            if name not in tensors:
                raise CheckpointError(f"optimizer state refers to tensor {name!r}, which is not in the checkpoint")
            return tensors[name]
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value
