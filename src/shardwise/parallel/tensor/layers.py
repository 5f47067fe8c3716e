"""Tensor-parallel layers (Megatron-LM) with a sequence-parallel mode, built by slicing single-device layers.

Shoeybi et al. 2019, "Megatron-LM", §3: a linear layer ``Y = X A^T`` is split by rows of its weight
``A`` (output features; "column parallel" in the paper's ``X A`` notation) or by its columns (input
features; "row parallel"). An MLP or attention block is one column-parallel layer followed by one
row-parallel layer, so each rank computes its slice of the hidden features (or its attention heads)
without communicating; one collective enters the region (f: identity forward, all-reduce backward)
and one leaves it (g: all-reduce forward). The embedding is split over the vocabulary (§3, "parallelize
the input embedding weight matrix along the vocabulary dimension"): each rank looks up the tokens of
its own range and zeroes the others, and g sums the ranks' rows.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2) keeps the activations *outside* the regions (norms, dropout, residual
adds) split along the sequence: f becomes an all-gather along the sequence and g a reduce-scatter
along it -- the same bytes as the all-reduce (a ring all-reduce *is* a reduce-scatter and an
all-gather), but the layers in between hold and compute 1/tp of the tokens.

Every layer here is built from the single-device layer by slicing its weight (``from_linear``,
``from_embedding``), so any tp builds the same model. Parameters keep their single-device names (the
module paths are unchanged) and carry :class:`TPShard` metadata -- which dim of the full tensor they
split, the rows they hold, and whether other ranks hold the same piece -- as ``param.tp_shard``,
with the shorthands ``param.tp_axis`` (the mesh axis, "tp") and ``param.shard_dim`` (an int, or
``None`` for a full copy). Layout-free checkpoints and gradient norms read them.

The communication is the autograd Functions of :mod:`shardwise.dist.functional`; this module only
slices weights and says where the region begins and ends. With ``overlap`` (``parallel.tp_comm_overlap``) the
collective next to a projection is decomposed with it instead (:mod:`shardwise.parallel.tensor.overlap`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.dist.comm.counting import CommStats
from shardwise.dist.functional import (
    all_reduce_grad,
    copy_to_region,
    gather_seq,
    reduce_from_region,
    reduce_scatter_seq,
)
from shardwise.parallel.tensor.overlap import OverlappedRegion, Steps, enter_linear, linear_leave

# ---- how a parameter is laid out over the tensor-parallel axis ------------------------------------


@dataclass(frozen=True)
class TPShard:
    """What piece of the single-process parameter this rank's tensor holds.

    Along ``dim`` the local tensor holds rows ``start .. stop`` of the full tensor in its first
    ``stop - start`` entries; entries past those are padding (zeros; e.g. vocabulary rows added so that
    the vocabulary divides by tp). ``dim=None``: a full copy (``start, stop`` span ``full_shape[0]``).
    """

    axis: str
    """The mesh axis the parameter is laid out on ("tp")."""
    dim: int | None
    """The dim of the full tensor that is split; ``None``: every rank of the axis holds all of it."""
    full_shape: tuple[int, ...]
    """The single-process parameter's shape (without padding)."""
    start: int
    """First row (along ``dim``) of the full tensor held here."""
    stop: int
    """One past the last row held here (``stop - start`` may be less than the local size: padding)."""
    replicas: int = 1
    """Ranks of the axis that hold this same piece: 1 for a plain shard, tp for a full copy,
    tp / n_kv_heads for key/value heads replicated because tp > n_kv_heads."""
    owner: bool = True
    """Whether this rank is the first of the ``replicas``: the one that writes the piece to a
    checkpoint and counts it in a gradient norm."""
    grad_sync: str | None = None
    """How the gradient is made whole by a hook that :func:`install_grad_sync` registers:
    ``None`` (autograd already gives the full gradient of this piece on every rank),
    ``"sum"`` (each rank's gradient is partial -- sequence parallelism: the rank saw only its tokens --
    and the hook all-reduces it over the axis), or ``"replicas"`` (each replica's gradient is partial --
    key/value heads shared by several ranks' query heads -- and the hook sums it over the replicas)."""

    def full_index(self) -> tuple[slice, ...]:
        """Index of the full tensor that this piece holds (``full[info.full_index()]``)."""
        if self.dim is None:
            return (slice(None),)
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)

    def local_index(self) -> tuple[slice, ...]:
        """Index of the local tensor that holds real (non-padding) values."""
        if self.dim is None:
            return (slice(None),)
        return (slice(None),) * self.dim + (slice(0, self.stop - self.start),)

    def take(self, full: torch.Tensor, local_size: int | None = None) -> torch.Tensor:
        """This rank's piece of ``full`` (a new tensor), zero-padded along ``dim`` to ``local_size``."""
        piece = full[self.full_index()]
        if self.dim is None or local_size is None or local_size == piece.shape[self.dim]:
            return piece.clone()
        shape = list(piece.shape)
        shape[self.dim] = local_size
        out = piece.new_zeros(shape)
        out[self.local_index()] = piece
        return out

    @property
    def real_rows(self) -> int:
        """Rows along ``dim`` that hold real values (the rest of the local size is padding)."""
        return self.stop - self.start

    def run_start(self, lead: int) -> int:
        """Where, in the flattened full tensor, the real rows of the local tensor's ``lead``-th run begin (one run
        per index of the dims before ``dim``: ``rows = stop - start`` rows along ``dim`` and everything after)."""
        return (lead * self.full_shape[self.dim] + self.start) * math.prod(self.full_shape[self.dim + 1:])


@dataclass(frozen=True)
class ExpertRowsOfSplit:
    """An expert-parallel shard of a tensor-parallel split: experts ``start .. stop`` (dim 0) of a stacked expert
    tensor ``[E, ...]`` of which ``split`` holds some rows along a later dim (expert tensor parallelism with
    expert parallelism, :mod:`shardwise.parallel.expert.tensor`): the local tensor is
    ``full[start:stop][split's rows]``. It answers what a :class:`TPShard` answers (``dim``, ``full_index``,
    ``take``, ``run_start``), so checkpoints, loading, ZeRO and the gradient norm read it alike."""

    split: TPShard
    start: int
    stop: int
    axis: str = "ep"
    owner: bool = True
    replicas: int = 1
    grad_sync: str | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.split.full_shape

    @property
    def dim(self) -> int:
        return self.split.dim

    @property
    def real_rows(self) -> int:
        return self.split.real_rows

    def full_index(self) -> tuple[slice, ...]:
        return (slice(self.start, self.stop), *self.split.full_index()[1:])

    def local_index(self) -> tuple[slice, ...]:
        return self.split.local_index()

    def take(self, full: torch.Tensor, local_size: int | None = None) -> torch.Tensor:
        return self.split.take(full[self.start:self.stop], local_size)

    def run_start(self, lead: int) -> int:
        per_expert = math.prod(self.full_shape[1:self.dim])  # runs of one expert
        expert, rest = divmod(lead, per_expert)
        return self.split.run_start((self.start + expert) * per_expert + rest)


def mark(p: nn.Parameter, info: TPShard) -> nn.Parameter:
    """Attach ``info`` to ``p`` as ``p.tp_shard`` (and ``p.tp_axis``, ``p.shard_dim``)."""
    p.tp_shard = info
    p.tp_axis = info.axis
    p.shard_dim = info.dim
    return p


def replicated(p: torch.Tensor, axis: str, tp: int, rank: int, grad_sync: str | None) -> TPShard:
    """The metadata of a parameter that every rank of the axis holds whole."""
    n = p.shape[0] if p.dim() else 1
    return TPShard(axis, None, tuple(p.shape), 0, n, replicas=tp, owner=rank == 0, grad_sync=grad_sync)


def _piece(full: torch.Tensor, info: TPShard, local_size: int) -> nn.Parameter:
    with torch.no_grad():
        value = info.take(full.detach(), local_size)
    return mark(nn.Parameter(value, requires_grad=full.requires_grad), info)


def even_rows(n: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    """Rows ``[rank * n/tp, (rank+1) * n/tp)``; ``ValueError`` naming ``what`` unless tp divides n."""
    if n % tp:
        raise ValueError(f"{what}={n} does not divide by tp={tp}")
    k = n // tp
    return rank * k, (rank + 1) * k


def padded_rows(n: int, tp: int, rank: int) -> tuple[int, int, int]:
    """``(start, stop, local)`` of an n-row tensor padded up to a multiple of tp: each rank holds
    ``local = ceil(n / tp)`` rows, of which rows ``start .. stop`` are real (``stop - start`` may be
    less than ``local``, or zero)."""
    local = -(-n // tp)
    start = min(rank * local, n)
    return start, min(start + local, n), local


def _group_coords(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


# ---- layers ---------------------------------------------------------------------------------------


class EnterRegion:
    """A forward pre-hook that moves a module's first input into the tensor-parallel region once: f
    (``copy_to_region``), or with sequence parallelism the all-gather along the sequence
    (``gather_seq``). Registered on a module whose several column-parallel projections read the same
    input -- the attention (q, k, v) and the SwiGLU MLP (gate, up) -- so that one collective serves them
    all, as Megatron's fused QKV GEMM does (Shoeybi et al. 2019, §3)."""

    def __init__(self, group, stats: CommStats | None = None, sequence_parallel: bool = False):
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_seq(x, self.group, self.stats)
        return copy_to_region(x, self.group, self.stats)

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (self.enter(args[0]), *args[1:])


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i^T (+ b_i)``: this rank's rows ``A_i`` of the weight (its output features).

    With ``enter_region`` the layer moves its input into the region itself (f, or the sequence
    all-gather with ``sequence_parallel``); without, the caller already has (an :class:`EnterRegion`
    hook on the enclosing module). The output stays split over the last dim: it feeds a
    :class:`RowParallelLinear` or a vocabulary-parallel loss, never a gather. The local matmul is
    :attr:`local_linear` (``F.linear``), which a zero-bubble schedule replaces to defer its weight gradients
    (:func:`shardwise.parallel.pipeline.zero_bubble.defer_linear_weight_grads`). With ``overlap`` the layer
    entering the region itself decomposes the entry with its matmul; inside an overlapped ``region`` (an
    :class:`~shardwise.parallel.tensor.overlap.OverlappedRegion` hook) the region's first projection does.
    """

    local_linear = staticmethod(F.linear)

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, stats: CommStats | None = None,
                 *, sequence_parallel: bool = False, enter_region: bool = True, overlap: bool = False,
                 region: OverlappedRegion | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.entry = EnterRegion(group, stats, sequence_parallel) if enter_region else None
        self.steps = Steps(group, stats) if overlap and enter_region else None
        """With ``overlap``: how this layer, entering the region itself, communicates (:mod:`.overlap`)."""
        self.region = region

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group,
        stats: CommStats | None = None,
        *,
        sequence_parallel: bool = False,
        enter_region: bool = True,
        overlap: bool = False,
        region: OverlappedRegion | None = None,
        rows: tuple[int, int] | None = None,
        local_rows: int | None = None,
        replicas: int = 1,
        owner: bool = True,
        axis: str = "tp",
    ) -> ColumnParallelLinear:
        """This rank's piece of ``linear``: output rows ``rows`` (default: an even 1/tp split), zero-
        padded to ``local_rows``; ``replicas`` ranks hold the same rows (``owner``: this is the first)."""
        tp, rank = _group_coords(group)
        out = linear.out_features
        start, stop = rows if rows is not None else even_rows(out, tp, rank, f"out_features of {linear}")
        local = local_rows if local_rows is not None else stop - start
        sync = "replicas" if replicas > 1 else None
        w = TPShard(axis, 0, tuple(linear.weight.shape), start, stop, replicas, owner, sync)
        b = None
        if linear.bias is not None:
            b = _piece(linear.bias, TPShard(axis, 0, (out,), start, stop, replicas, owner, sync), local)
        return cls(_piece(linear.weight, w, local), b, group, stats, sequence_parallel=sequence_parallel,
                   enter_region=enter_region, overlap=overlap, region=region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.region is not None:
            return self.region.project(x, self)
        if self.steps is not None:
            return enter_linear(x, self.weight, self.bias, self.steps, self.entry.sequence_parallel)[0]
        if self.entry is not None:
            x = self.entry.enter(x)
        return self.local_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, local_out_features={self.out_features}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """``Y = sum_i X_i A_i^T + b``: this rank's columns ``A_i`` of the weight (its input features),
    applied to its slice ``X_i`` of the input; g (or the sequence reduce-scatter) sums the ranks'
    partial products and the bias is added once, after the reduction (Shoeybi et al. 2019, §3). The local
    matmul is :attr:`local_linear`, as in :class:`ColumnParallelLinear`; with ``overlap`` the matmul and the
    reduction are decomposed together (:func:`~shardwise.parallel.tensor.overlap.linear_leave`)."""

    local_linear = staticmethod(F.linear)

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, stats: CommStats | None = None,
                 *, sequence_parallel: bool = False, overlap: bool = False):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel
        self.steps = Steps(group, stats) if overlap else None
        """With ``overlap``: how the matmul and the reduction communicate (:mod:`.overlap`)."""

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, stats: CommStats | None = None, *,
                    sequence_parallel: bool = False, axis: str = "tp", overlap: bool = False) -> RowParallelLinear:
        """This rank's even 1/tp of ``linear``'s input features; the bias whole on every rank."""
        tp, rank = _group_coords(group)
        start, stop = even_rows(linear.in_features, tp, rank, f"in_features of {linear}")
        w = _piece(linear.weight, TPShard(axis, 1, tuple(linear.weight.shape), start, stop), stop - start)
        b = None
        if linear.bias is not None:
            # after a reduce-scatter each rank adds the bias to its own tokens only: partial gradient
            b = _piece(linear.bias, replicated(linear.bias, axis, tp, rank, "sum" if sequence_parallel else None),
                       linear.out_features)
        return cls(w, b, group, stats, sequence_parallel=sequence_parallel, overlap=overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.steps is not None:
            y = linear_leave(x, self.weight, self.steps, self.sequence_parallel)
            return y if self.bias is None else y + self.bias
        y = self.local_linear(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_seq(y, self.group, self.stats)
        else:
            y = reduce_from_region(y, self.group, self.stats)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"local_in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary (Shoeybi et al. 2019, §3): this rank holds rows
    ``vocab_start .. vocab_start + local`` of the table (padded to ``ceil(V / tp)`` rows); tokens outside
    its real range (another rank's, or padding ids) look up zeros, and g sums the ranks' rows -- or,
    with sequence parallelism, the reduce-scatter along the sequence leaves each rank its tokens."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, vocab_size: int, group,
                 stats: CommStats | None = None, *, sequence_parallel: bool = False):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.vocab_size = vocab_start, vocab_size
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group, stats: CommStats | None = None, *,
                       sequence_parallel: bool = False, axis: str = "tp") -> VocabParallelEmbedding:
        tp, rank = _group_coords(group)
        v = emb.num_embeddings
        start, stop, local = padded_rows(v, tp, rank)
        w = _piece(emb.weight, TPShard(axis, 0, tuple(emb.weight.shape), start, stop), local)
        return cls(w, start, v, group, stats, sequence_parallel=sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        real = min(self.weight.shape[0], self.vocab_size - self.vocab_start)
        outside = (local < 0) | (local >= real)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_seq(x, self.group, self.stats)
        return reduce_from_region(x, self.group, self.stats)

    def extra_repr(self) -> str:
        return (f"vocab_start={self.vocab_start}, local_rows={self.weight.shape[0]}, "
                f"vocab_size={self.vocab_size}, dim={self.weight.shape[1]}")


class SequenceParallelPositions(nn.Module):
    """A learned position table, whole on every rank, that returns the rows of this rank's piece of the
    sequence: called with positions ``[..., T]`` it looks up the rank's ``T / tp`` of them, to be added
    to activations split along the sequence. Its weight gradient is partial (the rank saw only its
    positions) and is summed over the axis by the ``"sum"`` hook (:func:`install_grad_sync`)."""

    def __init__(self, weight: nn.Parameter, group):
        super().__init__()
        self.weight = weight
        self.group = group

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group, *, axis: str = "tp") -> SequenceParallelPositions:
        tp, rank = _group_coords(group)
        return cls(_piece(emb.weight, replicated(emb.weight, axis, tp, rank, "sum"), emb.num_embeddings), group)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        tp, rank = _group_coords(self.group)
        if positions.shape[-1] % tp:
            raise ValueError(f"sequence parallelism: sequence length {positions.shape[-1]} does not divide by tp={tp}")
        return F.embedding(positions.chunk(tp, dim=-1)[rank], self.weight)


# ---- gradient hooks --------------------------------------------------------------------------------


class _SumOverAxis:
    """Gradient hook: the sum of the ranks' partial gradients over the axis (``grad_sync="sum"``)."""

    def __init__(self, group, stats):
        self.group, self.stats = group, stats

    def __call__(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return None if grad is None else all_reduce_grad(grad, self.group, self.stats)


class _SumOverReplicas:
    """Gradient hook (``grad_sync="replicas"``): the sum of the partial gradients of the ranks holding the
    same rows. Each rank writes its gradient into its rows of a zero tensor of the full parameter's
    shape, the tensor is all-reduced over the whole axis, and the rank keeps its rows: rows held by
    several ranks come back as the sum over exactly those ranks (the others added zeros), with no
    process group beyond the axis's own. Cost: one all-reduce of the full parameter per backward."""

    def __init__(self, info: TPShard, group, stats):
        self.info, self.group, self.stats = info, group, stats

    def __call__(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:  # a zero-bubble backward deferred this weight's gradient to its W (which calls again)
            return None
        full = grad.new_zeros(self.info.full_shape)
        full[self.info.full_index()] = grad[self.info.local_index()]
        full = all_reduce_grad(full, self.group, self.stats)
        out = torch.zeros_like(grad)
        out[self.info.local_index()] = full[self.info.full_index()]
        return out


def install_grad_sync(module: nn.Module, group, stats: CommStats | None = None) -> int:
    """Register, on every parameter of ``module`` whose ``tp_shard.grad_sync`` is set, a gradient hook
    (``Tensor.register_hook``) that makes its gradient whole (see :class:`TPShard`). Returns how many.

    The hook runs in backward on each gradient *before* it is accumulated into ``.grad``, once per
    backward pass: gradients accumulated over micro-batches stay correct (the sum is linear), and a
    data-parallel wrapper's post-accumulate hooks see the already-summed gradient. The engine calls
    nothing. Hooks belong to the Parameter objects: replacing a parameter (``to_empty`` from the meta
    device) drops them -- call this again on the new parameters.
    """
    n = 0
    seen: set[int] = set()
    for p in module.parameters():
        info = getattr(p, "tp_shard", None)
        if id(p) in seen or info is None or info.grad_sync is None or not p.requires_grad:
            continue
        seen.add(id(p))
        hook = _SumOverAxis(group, stats) if info.grad_sync == "sum" else _SumOverReplicas(info, group, stats)
        p.register_hook(hook)
        n += 1
    return n


__all__ = [
    "ColumnParallelLinear", "EnterRegion", "ExpertRowsOfSplit", "RowParallelLinear", "SequenceParallelPositions",
    "TPShard", "VocabParallelEmbedding", "even_rows", "install_grad_sync", "mark", "padded_rows", "replicated",
]
