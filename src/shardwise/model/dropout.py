"""Dropout whose masks do not depend on how the work is split over processes.

Dropout (Srivastava et al. 2014, "Dropout: A Simple Way to Prevent Neural Networks from Overfitting", JMLR
15, §2) zeroes each activation with probability p and scales the others by 1 / (1 - p). Here the mask is a
pure function of where an element sits in the *single-process* computation, drawn by the counter-based
generator Philox4x32-10 (:mod:`shardwise.model.philox`; Salmon et al. 2011):

* the key is ``(seed, step)`` (a :class:`DropoutKey`, handed to the model's ``forward`` by whoever runs it);
* two counter words are the site: the block's ``layer`` id and which dropout of it (:data:`SITES`);
* the other two are the element's global index ``g`` in the site's single-process tensor divided by 8:
  each Philox call gives 128 bits, eight 16-bit uniforms, for elements ``8n .. 8n + 7``.

The global index counts the sequence's place in the step's global batch first (the micro-batch's
first sequence, :attr:`DropoutKey.first_sequence`, plus the row), then the site's own axes at their global
extents: tokens and features for the embedding and the residual branches ``[B, T, D]``, heads, query and
key positions for the attention probabilities ``[B, H, T, T]``, features for bert's classifier ``[B, D]``.

On one process every local index is the global one. A process that holds a slice -- some heads (tensor
parallelism), some tokens (sequence or context parallelism), some sequences (data parallelism, micro-
batches), some layers (pipeline stages) -- is told so from outside: :attr:`Dropout.tokens` and
:attr:`Attention.heads <shardwise.model.layers.Attention>` (a :class:`Span` each), the key's first
sequence, the blocks' layer ids. It then draws exactly the mask one process draws for its elements, and
nothing for the others: no full-size mask exists anywhere. Recomputation (activation checkpointing) is
handed the same key and redraws the same mask.

How a mask is drawn depends on the device (:class:`MaskPlan`), never its bits: on a CPU in passes of
:data:`CHUNK` calls that stay in the cache, a causal attention mask drawing only the calls it reads; on any
other device the whole tensor in one pass (a fixed number of operators, ~170 per site at any size, where the
passes would launch ~150 kernels per 32K calls), with nothing read back by the host. Under ``train.compile``
the whole-tensor plan is traced into the block's compiled region, where TorchInductor fuses the generator; the
key enters as tensors, so the region is compiled again once when the key first changes (TorchDynamo then makes
its ints symbolic), not for every step or micro-batch.

The keep probability is ``1 - p`` rounded to a multiple of 2^-16 (:func:`threshold`: p = 0.1 drops with
probability 6554 / 65536 = 0.100006); the kept values are scaled by the inverse of the probability used,
so every activation's expectation is unchanged. Without a key (a model called by code that does not give
one: a user's script, the parameter server's workers, the torch peers of ``bench/``) the masks come from
torch's generator, as ``nn.Dropout`` and ``scaled_dot_product_attention(dropout_p=...)`` draw them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from shardwise.model.philox import WORD, philox4x32_, philox4x32_traced

SITES = {"embed": 0, "attn_out": 1, "mlp_out": 2, "attn_probs": 3, "classifier": 4}
"""Which dropout of a layer a mask belongs to (a counter word): the embedding's, the attention and MLP
residual branches', the attention probabilities', bert's classifier input's."""
MODEL_LAYER = -1
"""The layer id of the sites outside the blocks (embedding, classifier)."""
LANES = 8
"""16-bit uniforms per Philox call (four 32-bit words, two halves each)."""
CHUNK = 1 << 15
"""Philox calls per pass on a CPU: the generator's working set (seven int64 tensors) stays in its cache."""


@dataclass(frozen=True)
class DropoutKey:
    """Which draw: the run's ``seed`` (its low 32 bits), the optimizer ``step``, and ``first_sequence``, the
    place in the step's global batch of the first sequence of the micro-batch the model is given."""

    seed: int
    step: int
    first_sequence: int = 0

    def shifted(self, sequences: int) -> DropoutKey:
        """The key of the micro-batch that starts ``sequences`` sequences later in the same batch."""
        return dataclasses.replace(self, first_sequence=self.first_sequence + sequences)


@dataclass(frozen=True, eq=False)
class Span:
    """Which entries of a global axis of length ``extent`` a process holds: ``index`` (int64), the global
    index of each local entry, in local order."""

    index: torch.Tensor
    extent: int

    @classmethod
    def whole(cls, n: int, device=None) -> Span:
        """All ``n`` entries: what one process holds."""
        return cls(torch.arange(n, device=device), n)


def threshold(p: float) -> int:
    """A 16-bit uniform ``u`` drops its element when ``u < threshold(p)`` (at most 65535: one value keeps)."""
    return min(round(p * 65536), 65535)


def keep_scale(p: float) -> float:
    """The factor of the kept elements: the inverse of the keep probability :func:`threshold` gives."""
    return 65536 / (65536 - threshold(p))


@dataclass(frozen=True)
class MaskPlan:
    """How a mask is drawn: ``chunk`` Philox calls per pass (None: the whole tensor in one pass, a fixed number
    of operators whatever its size), and ``skip_unread``: a causal mask draws only the calls that hold a key
    at or before its query, which it finds with ``nonzero`` (a data-dependent shape: a host synchronisation
    on an accelerator, free on a CPU)."""

    chunk: int | None
    skip_unread: bool
    fused: bool = False
    """The whole-tensor plan only: drawn by one compiled kernel (:func:`_draw` under ``torch.compile``, compiled at
    its first use) also outside a compiled region, where no dispatch mode watches."""

    @classmethod
    def for_device(cls, device: torch.device | str) -> MaskPlan:
        """The CPU's plan: passes of :data:`CHUNK` calls (the working set stays in its cache) skipping the calls a
        causal mask does not read. Any other device: the whole tensor in one pass, nothing skipped, fused -- a GPU
        launches one kernel per mask (eagerly ~160, where the passes took ~150 per 32K calls) and never waits for
        a ``nonzero``."""
        return cls(CHUNK, True) if torch.device(device).type == "cpu" else cls(None, False, fused=True)


def keep_mask(p: float, key: DropoutKey, layer: int, site: str, index: Sequence[torch.Tensor],
              extents: Sequence[int], causal: bool = False, *, aligned: bool | None = None,
              plan: MaskPlan | None = None) -> torch.Tensor:
    """The keep mask (bool, ``[len(i) for i in index]``) of the elements at global ``index``: ``index[0]``
    the sequences' places in the global batch, ``index[j]`` the global indices along axis ``j`` of the
    site's tensor, whose global length is ``extents[j - 1]``. Element ``(i_0, .., i_n)`` has the global
    index ``(..((i_0 e_1 + i_1) e_2 + i_2)..) e_n + i_n``.

    ``causal``: the last two axes are query and key positions and only keys at or before their query are
    read (causal attention, whose probabilities elsewhere are zero): the others come back False.

    ``aligned``: whether the last axis holds whole runs of eight (:func:`aligned_index`), which the caller
    knows from how it built the index (None: read from the index, a host synchronisation on an accelerator);
    ``plan``: how to draw (default :meth:`MaskPlan.for_device` of the index's device)."""
    plan = plan or MaskPlan.for_device(index[-1].device)
    if aligned is None:
        aligned = aligned_index(index[-1], extents[-1])
    if plan.chunk is not None:
        draw = _draw_eagerly
    elif plan.fused and _fusable(index[-1]):
        draw = _FUSED
    else:
        draw = _draw
    return draw(p, key, layer, site, index, extents, causal, aligned, plan)


def _draw(p: float, key: DropoutKey, layer: int, site: str, index: Sequence[torch.Tensor], extents: Sequence[int],
          causal: bool, aligned: bool, plan: MaskPlan) -> torch.Tensor:
    shape = [len(i) for i in index]
    last, e_last = index[-1], extents[-1]
    read = (last.unsqueeze(0) <= index[-2].unsqueeze(1)) if causal else None  # [queries, keys]
    if aligned:  # every 8 local elements along the last axis are one Philox call's
        blocks = _linear([*index[:-1], last[::LANES] // LANES], [*extents[:-1], e_last // LANES]).flatten()
        if read is None:
            return _keep_blocks(blocks, p, key, layer, site, plan.chunk).view(shape)
        if not plan.skip_unread:
            return _keep_blocks(blocks, p, key, layer, site, plan.chunk).view(shape) & read
        calls = read[:, ::LANES].expand(*shape[:-1], shape[-1] // LANES).flatten().nonzero().squeeze(1)
        keep = torch.zeros(len(blocks), dtype=torch.int64, device=blocks.device)  # a call's 8 bools as one int64
        keep[calls] = _keep_blocks(blocks[calls], p, key, layer, site, plan.chunk).view(torch.int64).squeeze(1)
        return keep.view(torch.bool).view(shape) & read  # (a call is read when its first, earliest key is)
    g = _linear(index, extents).flatten()  # otherwise: each element's call, and its lane of the eight
    keep = _keep_blocks(g // LANES, p, key, layer, site, plan.chunk).gather(1, (g % LANES).unsqueeze(1)).view(shape)
    return keep if read is None else keep & read


_draw_eagerly = torch.compiler.disable(_draw)
"""The CPU's plan under torch.compile: drawn eagerly, in passes that skip a causal mask's unread calls (measured on
this 2-core CPU, B 2, H 8, T 1024: 0.07 s eagerly, 0.27 s for the whole-tensor plan compiled, which draws them all).
The whole-tensor plan of other devices is traced into the compiled region (one fused kernel per mask), the key as
tensors (:func:`~shardwise.model.philox.philox4x32_traced`): one graph for every step and micro-batch."""


def _fusable(t: torch.Tensor) -> bool:
    """Whether a mask on ``t``'s device is drawn by the compiled kernel: a device TorchInductor builds kernels for
    (not a CPU, whose passes are faster; not meta), not inside a region being compiled (which traces :func:`_draw`
    itself), and no dispatch mode watching (a counter counts the eager operators)."""
    return (t.device.type not in ("cpu", "meta") and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None)


GRAPHS = 64
"""How many graphs of the compiled mask TorchDynamo may keep: two per site and shape (the first key's constants,
then the key symbolic). Its default, 8, is four sites' worth -- a classifier's fifth site, or context parallelism's
block shapes, would pass it, and with ``fullgraph`` that fails rather than drawing the new shape eagerly."""


class _FusedDraw:
    """:func:`_draw` compiled: each mask one fused kernel. Compiled at its first call, per site and shape, once more
    when the key or layer first changes (TorchDynamo then makes those ints symbolic; the key enters the generator
    as tensors, :func:`~shardwise.model.philox.philox4x32_traced`), never per step; up to :data:`GRAPHS` graphs.
    If compilation fails the masks are drawn eagerly -- the same bits, ~160 kernels each -- after one warning that
    says why. ``backend``: torch.compile's (TorchInductor; the tests trace with "eager" to count graphs quickly)."""

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self.compiled = None
        self.failed: str | None = None

    def __call__(self, *args) -> torch.Tensor:
        if self.failed is None:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(_draw, fullgraph=True, backend=self.backend)
                for t in args[4]:  # the index: static shapes (TorchInductor's CPU code for them drew other bits)
                    torch._dynamo.mark_static(t)
                with torch._dynamo.config.patch(recompile_limit=GRAPHS):
                    return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: fall back to the same bits eagerly
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                warnings.warn(f"dropout masks are drawn eagerly (~160 kernels per mask): torch.compile of the "
                              f"mask failed: {self.failed}", RuntimeWarning, stacklevel=2)
        return _draw(*args)


_FUSED = _FusedDraw()
"""The compiled mask of the devices that are not a CPU (compiled once per process, at its first use)."""


def aligned_index(last: torch.Tensor, extent: int) -> bool:
    """Whether the global indices ``last`` along a site's last axis (of global length ``extent``) are runs of eight
    consecutive indices starting at multiples of eight: then every eight local elements are one Philox call's.
    Reads ``last`` (build it on the host to keep a device waiting for nothing)."""
    n = len(last)
    if extent % LANES or n % LANES:
        return False
    runs = last.view(-1, LANES)
    return bool(((runs[:, 0] % LANES == 0) & (runs == runs[:, :1] + torch.arange(LANES, device=last.device)).all(1))
                .all())


def _linear(index: Sequence[torch.Tensor], extents: Sequence[int]) -> torch.Tensor:
    g = index[0].to(torch.int64)
    for idx, extent in zip(index[1:], extents, strict=True):
        g = g.unsqueeze(-1) * extent + idx.to(g.device, torch.int64)
    return g


def _keep_blocks(blocks: torch.Tensor, p: float, key: DropoutKey, layer: int, site: str,
                 chunk: int | None = CHUNK) -> torch.Tensor:
    """``[n, 8]`` bool: the keep decisions of the eight elements of each Philox call ``blocks[i]``, ``chunk`` calls
    per pass (None: all in one, written without ``out=`` so that torch.compile traces it whole)."""
    n, thr = len(blocks), threshold(p)
    if chunk is None:
        philox = philox4x32_traced if torch.compiler.is_compiling() else philox4x32_
        words = philox(_counter(blocks, layer, site), (key.seed, key.step))
        return torch.stack([torch.stack(((w & 0xFFFF) >= thr, w >= thr << 16), 1) for w in words], 1).view(n, LANES)
    out = torch.empty(n, 4, 2, dtype=torch.bool, device=blocks.device)
    for start in range(0, n, chunk):
        b = blocks[start:start + chunk]
        for j, word in enumerate(philox4x32_(_counter(b, layer, site), (key.seed, key.step))):
            rows = out[start:start + len(b), j]
            torch.ge(word & 0xFFFF, thr, out=rows[:, 0])  # the low half of each word
            torch.ge(word, thr << 16, out=rows[:, 1])  # the high half
    return out.view(n, LANES)


def _counter(blocks: torch.Tensor, layer: int, site: str) -> list[torch.Tensor]:
    """The four counter words of Philox calls ``blocks`` (module docstring)."""
    return [blocks & WORD, blocks >> 32, torch.full_like(blocks, layer) & WORD, torch.full_like(blocks, SITES[site])]


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with the dropped elements zeroed and the kept ones scaled (autograd keeps only the bool mask)."""
    return (x * keep_scale(p)).where(keep, 0.0)


class Dropout(nn.Module):
    """The dropout at one ``site`` of layer ``layer`` (:data:`MODEL_LAYER` outside the blocks), on ``x`` of
    ``[B, T, D]`` (embedding, residual branches) or ``[B, D]`` (bert's classifier).

    :attr:`tokens` says which tokens of the sequence ``x``'s ``T`` are (None: all of them, in order) -- set
    from outside by a technique that splits the sequence."""

    def __init__(self, p: float, site: str, layer: int = MODEL_LAYER):
        super().__init__()
        if site not in SITES:
            raise ValueError(f"dropout site {site!r} is not one of {', '.join(SITES)}")
        self.p, self.site, self.layer = p, site, layer
        self.tokens: Span | None = None

    def forward(self, x: torch.Tensor, dropout_key: DropoutKey | None = None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if dropout_key is None:
            return F.dropout(x, self.p, training=True)
        seqs = dropout_key.first_sequence + torch.arange(x.shape[0], device=x.device)
        features = torch.arange(x.shape[-1], device=x.device)
        if x.dim() == 2:
            index, extents = [seqs, features], [x.shape[-1]]
        else:
            tokens = self.tokens or Span.whole(x.shape[1], x.device)
            if len(tokens.index) != x.shape[1]:
                raise ValueError(f"dropout at {self.site} of layer {self.layer}: {x.shape[1]} tokens, but this "
                                 f"process was told it holds {len(tokens.index)}")
            index, extents = [seqs, tokens.index, features], [tokens.extent, x.shape[-1]]
        keep = keep_mask(self.p, dropout_key, self.layer, self.site, index, extents, aligned=x.shape[-1] % LANES == 0)
        return apply_keep(x, keep, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}, layer={self.layer}"


@dataclass(frozen=True, eq=False)
class AttentionDropout:
    """The dropout of one attention call's probabilities: ``p``, the ``key``, the ``layer``, and ``heads``
    (the global ids of the query heads the call computes). An attention core draws the mask of any block of
    queries and keys it computes with :meth:`keep`."""

    p: float
    key: DropoutKey
    layer: int
    heads: Span

    def keep(self, batch: int, queries: torch.Tensor, keys: torch.Tensor, seq_len: int,
             heads: torch.Tensor | None = None, causal: bool = False, keys_aligned: bool | None = None
             ) -> torch.Tensor:
        """``[batch, H, len(queries), len(keys)]`` bool for query and key positions (global, in a sequence of
        ``seq_len``) of ``heads`` (global ids; default all of :attr:`heads`); ``causal``: keys after their
        query come back False (their probabilities are zero); ``keys_aligned``: whether ``keys`` are runs of
        eight (:func:`aligned_index`; None: read from ``keys``), see :func:`keep_mask`."""
        seqs = self.key.first_sequence + torch.arange(batch, device=queries.device)
        index = [seqs, self.heads.index if heads is None else heads, queries, keys]
        return keep_mask(self.p, self.key, self.layer, "attn_probs", index, [self.heads.extent, seq_len, seq_len],
                         causal, aligned=keys_aligned)
