"""The pieces of the one table that maps our tensors to ``transformers``' (:mod:`shardwise.hf.recipes`): a
:class:`Part` of one ``transformers`` tensor, a :class:`Recipe` of parts, and the index arithmetic between our
tensor and the tensors it is read from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """Our tensor (or one expert of it) as ``transformers`` tensor ``name``: rows ``[start, stop)`` along ``dim``
    of it (all of it when ``dim`` is None), transposed (2-d) when ``transposed``."""

    name: str
    transposed: bool = False
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class Recipe:
    """One of our tensors: ``parts[0]`` itself, or (``stacked``) the parts stacked along a new dim 0.
    ``alias``: the same values as another of our tensors (a tied output head) -- read, never written."""

    parts: tuple[Part, ...]
    stacked: bool = False
    alias: bool = False


def our_index(recipe: Recipe, index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[Part, tuple]]:
    """The ``transformers`` reads that give ``ours[index]`` (one slice per dim of our tensor of ``shape``): for a
    plain recipe one ``(part, their index)``; for a stacked one, one per expert in ``index[0]`` (their index
    then covers the remaining dims). A caller transposes a transposed part's result and stacks stacked ones."""
    if recipe.stacked:
        rows = range(*index[0].indices(shape[0]))
        return [(recipe.parts[j], _their_index(recipe.parts[j], index[1:])) for j in rows]
    return [(recipe.parts[0], _their_index(recipe.parts[0], index))]


def _their_index(part: Part, index: tuple[slice, ...]) -> tuple[slice, ...]:
    theirs = list(reversed(index)) if part.transposed else list(index)
    if part.dim is not None:
        s = theirs[part.dim]
        start = part.start + (s.start or 0)
        stop = part.start + (s.stop if s.stop is not None else part.stop - part.start)
        theirs[part.dim] = slice(start, stop)
    return tuple(theirs)


def our_shape(recipe: Recipe, shape_of) -> tuple[int, ...]:
    """Our tensor's shape from the ``transformers`` shapes (``shape_of(name) -> tuple``)."""
    part = recipe.parts[0]
    shape = list(shape_of(part.name))
    if part.dim is not None:
        shape[part.dim] = part.stop - part.start
    if part.transposed:
        shape.reverse()
    return (len(recipe.parts), *shape) if recipe.stacked else tuple(shape)
