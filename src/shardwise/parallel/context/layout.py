"""Which tokens of a sequence each context-parallel rank holds, and at which positions.

Context parallelism splits the sequence of every layer over the ``cp`` ranks. With a causal mask a
contiguous split is unbalanced: rank ``r`` of ``cp`` attends to ``r + 1/2`` blocks of keys, so the last
rank does ``2cp - 1`` times the work of the first. The head-tail ("zigzag") split of Megatron-Core's
context parallelism and of Brandon et al. 2023 ("Striped Attention", §3 discusses the same imbalance)
cuts the sequence into ``2 cp`` chunks and gives rank ``r`` chunks ``r`` and ``2cp - 1 - r``: every
rank then holds one early and one late chunk and does the same causal work.

A :class:`SequenceLayout` is pure arithmetic: :meth:`positions` are the global positions of a rank's
local tokens (in order -- they increase, so a causal mask inside a rank's own tokens is the ordinary
lower triangle), used to cut tokens and labels (:class:`ShardedWindows`) and to look up learned
position embeddings and rotary angles (:func:`use_global_positions`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

BALANCES = ("headtail", "none")


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence is cut over ``cp`` ranks (``balance``: "headtail" or "none"); ``rank``: this rank."""

    cp: int
    rank: int
    balance: str = "headtail"

    def __post_init__(self) -> None:
        if self.balance not in BALANCES:
            raise ValueError(f"parallel.cp_balance={self.balance!r} is not valid; use one of {', '.join(BALANCES)}")

    @property
    def chunks(self) -> int:
        """Equal chunks the global sequence is cut into: 2 cp (head-tail) or cp."""
        return 2 * self.cp if self.balance == "headtail" else self.cp

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """The global chunks ``rank`` holds, in order."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.cp - 1 - r) if self.balance == "headtail" else (r,)

    def check(self, seq_len: int) -> None:
        if seq_len % self.chunks:
            raise ValueError(f"data.seq_len={seq_len} does not divide into {self.chunks} chunks for parallel.cp="
                             f"{self.cp} with parallel.cp_balance={self.balance!r}; use a multiple of {self.chunks}")

    @functools.lru_cache(maxsize=32)  # noqa: B019 - a few small layouts per run; asked for by every layer
    def positions(self, local_len: int, rank: int | None = None, device=None) -> torch.Tensor:
        """Global positions (int64, increasing) of the ``local_len`` tokens ``rank`` holds (cached: every
        layer's rotation asks for the same ones; callers index with it and never write to it)."""
        per = local_len // len(self.chunk_ids(rank))
        ids = [torch.arange(c * per, (c + 1) * per, device=device) for c in self.chunk_ids(rank)]
        return torch.cat(ids)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (full sequences along ``dim``)."""
        self.check(x.shape[dim])
        idx = self.positions(x.shape[dim] // self.cp, device=x.device)
        return x.index_select(dim, idx)


class ShardedWindows:
    """A view of :class:`~shardwise.data.TokenWindows` whose batches hold this rank's tokens and labels only.

    Every context-parallel rank of a data-parallel replica reads the same windows (the sampler is keyed by
    the data-parallel rank alone) and keeps its part of each sequence: inputs and labels get the same cut,
    so each local label stays next to its input."""

    def __init__(self, windows, layout: SequenceLayout):
        self.windows, self.layout = windows, layout

    def __len__(self) -> int:
        return len(self.windows)

    def __getattr__(self, name):
        return getattr(self.windows, name)

    def batch(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.windows.batch(ids)
        return self.layout.shard(x), self.layout.shard(y)


def shard_windows(windows, mesh, cfg):
    """``windows`` itself without context parallelism, else its :class:`ShardedWindows` for this rank."""
    if mesh.size("cp") == 1:
        return windows
    return ShardedWindows(windows, SequenceLayout(mesh.size("cp"), mesh.rank("cp"), cfg.parallel.cp_balance))


# ---- positions: learned tables and rotary angles at the global positions ---------------------------


def _lookup_at(emb: nn.Module, forward, layout: SequenceLayout, idx: torch.Tensor) -> torch.Tensor:
    """``emb(positions)`` where ``idx`` are local indices ``0..t-1`` (the model's ``arange(t)``)."""
    glob = layout.positions(idx.shape[-1], device=idx.device)[idx]
    return forward(glob)


def _rotate_at(rope, layout: SequenceLayout, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The rotary embedding's own rotation (:meth:`~shardwise.model.rope.RotaryEmbedding.rotate`) of ``x [B, H, t,
    hd]`` at the global positions of this rank's ``t`` local tokens (the model's own uses ``0..t-1``). Explicit
    ``positions`` (a key/value cache's decoding) do not occur in training and are refused."""
    if positions is not None:
        raise ValueError("a context-parallel model part takes its positions from the sequence layout")
    pos = layout.positions(x.shape[-2], device=rope.cos.device)
    return type(rope).rotate(rope, x, pos[None])


def use_global_positions(part: nn.Module, layout: SequenceLayout) -> None:
    """Make the learned position table (``pos_emb``: GPT-2) and the rotary embedding (Llama) of ``part`` use
    the global positions of this rank's tokens. ``forward``/``rotate`` are replaced on the instance, so
    parameter names and state dicts are unchanged (a sequence-parallel position table, which picks its
    tensor-parallel rank's rows of the positions it is given, composes: it is given global positions)."""
    from shardwise.model.layers import RotaryEmbedding

    pos = getattr(part, "pos_emb", None)
    if pos is not None:
        pos.forward = functools.partial(_lookup_at, pos, pos.forward, layout)
    for m in {id(m): m for m in part.modules() if isinstance(m, RotaryEmbedding)}.values():
        m.rotate = functools.partial(_rotate_at, m, layout)

