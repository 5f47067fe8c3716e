"""A ``transformers`` directory as our single-process model state, read slice by slice.

:class:`LazyHFState` is a read-only mapping from our state-dict keys to tensors (fp32 by default) that reads
nothing until asked, and then only what is asked: a whole tensor (``state[key]``), the rows a tensor- or
expert-parallel rank holds (:meth:`LazyHFState.read_rows`) or the elements of a ZeRO shard
(:meth:`LazyHFState.read_slice`), each through safetensors' ``get_slice`` on the tensors the recipe names
(:mod:`shardwise.hf.recipes`). The engine's layout-free loading (the path a checkpoint takes) calls those
methods when the mapping has them, so a rank never holds more of a pretrained model than its share plus the
piece it is copying. Files are opened per read and closed again: safetensors memory-maps them, and mapped
pages that were read would otherwise stay in the process's resident set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.hf.recipes import Recipe, our_index, our_shape

Index = tuple[slice, ...]


class HFFiles:
    """The tensors of a directory's safetensors files under their normalised names (``normalize(name)``)."""

    def __init__(self, files: list[Path], normalize: Callable[[str], str | None]):
        self.where: dict[str, tuple[Path, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    key = normalize(name)
                    if key is not None:
                        self.where[key] = (path, name)
                        self.shapes[key] = tuple(f.get_slice(name).get_shape())

    def read(self, name: str, index: Index) -> torch.Tensor:
        """``tensor[index]`` of the normalised tensor ``name``, read from its file alone (a copy)."""
        path, actual = self.where[name]
        with safe_open(str(path), framework="pt") as f:  # both copy out of the file: nothing stays mapped
            return f.get_slice(actual)[index] if index else f.get_tensor(actual)


class LazyHFState(Mapping):
    """Our model state (keys ``recipes``) read from ``files`` on demand, as ``dtype`` (None: the files' own)."""

    def __init__(self, files: HFFiles, recipes: dict[str, Recipe], dtype: torch.dtype | None = torch.float32):
        self.files, self.recipes, self.dtype = files, recipes, dtype
        self.shapes = {k: our_shape(r, files.shapes.__getitem__) for k, r in recipes.items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.recipes:
            raise KeyError(key)
        return self.read(key, tuple(slice(None) for _ in self.shapes[key]))

    def __contains__(self, key: object) -> bool:  # without reading the tensor
        return key in self.recipes

    def __iter__(self) -> Iterator[str]:
        return iter(self.recipes)

    def __len__(self) -> int:
        return len(self.recipes)

    def ndim(self, key: str) -> int:
        return len(self.shapes[key])

    def read(self, key: str, index: Index) -> torch.Tensor:
        """``ours[key][index]`` (one slice per dim), reading only the regions of the files it covers."""
        recipe, shape = self.recipes[key], self.shapes[key]
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
        pieces = []
        for part, theirs in our_index(recipe, index, shape):
            t = self.files.read(part.name, theirs)
            t = t.t() if part.transposed else t
            pieces.append(t if self.dtype is None else t.to(self.dtype))
        if recipe.stacked:
            inner = [s.stop - s.start for s in index[1:]]
            return torch.stack(pieces) if pieces else torch.empty(0, *inner, dtype=self.dtype or torch.float32)
        return pieces[0].contiguous()

    def read_rows(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` along ``dim`` (a tensor-parallel or expert-parallel rank's part)."""
        index = [slice(None)] * len(self.shapes[key])
        index[dim] = slice(start, stop)
        return self.read(key, tuple(index))

    def read_slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor (a ZeRO shard's piece), as a few rectangular reads."""
        return flat_read(lambda index: self.read(key, index), self.shapes[key], start, stop)


def flat_read(read: Callable[[Index], torch.Tensor], shape: tuple[int, ...], start: int, stop: int,
              prefix: Index = ()) -> torch.Tensor:
    """Elements ``[start, stop)`` of a flattened tensor of ``shape`` from rectangular reads ``read(index)``: a
    partial first row, the whole rows between, a partial last row, recursively -- no element outside the range
    is read. ``prefix``: the index of the sub-tensor ``shape`` describes."""
    if stop <= start:
        return torch.empty(0)
    if len(shape) <= 1:
        return read(prefix + (slice(start, stop),)).reshape(-1)
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    rest = (slice(None),) * (len(shape) - 1)
    if first == last:
        return flat_read(read, shape[1:], head, tail, prefix + (slice(first, first + 1),))
    out = []
    if head:
        out.append(flat_read(read, shape[1:], head, inner, prefix + (slice(first, first + 1),)))
        first += 1
    if last > first:
        out.append(read(prefix + (slice(first, last),) + rest).reshape(-1))
    if tail:
        out.append(flat_read(read, shape[1:], 0, tail, prefix + (slice(last, last + 1),)))
    return out[0] if len(out) == 1 else torch.cat(out)
