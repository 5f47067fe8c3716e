"""Expert tensor parallelism: every expert's MLP split over the tensor-parallel ranks (``parallel.etp``).

Megatron-Core splits each routed expert the way Shoeybi et al. 2019 (§3, Fig. 3) split a dense MLP: the first
projection by columns (``fc_in``, or SwiGLU's ``gate_proj`` and ``up_proj``: each rank computes ``d_ff / tp`` of
the hidden units), the second by rows (``fc_out`` / ``down_proj``: each rank's product is a partial sum over its
hidden units), so an expert's weights and its hidden activations are ``1 / tp`` per rank. Here the split runs
over the tensor-parallel group (``etp = tp``); Megatron's "parallel folding" (Liu et al. 2025, "MoE Parallel
Folding", where the experts' etp x ep x edp grid may differ from the attention's tp x cp x dp) is not built.

What enters and leaves the split, per :meth:`ExpertTensorParallel.forward` (the tokens already routed, sorted
by expert, and -- with expert parallelism -- already moved to this rank's experts by all-to-all):

* **without sequence parallelism** every tp rank holds the same tokens and routes them alike: the experts'
  input enters the region by Megatron's f (identity; its gradient, each rank's partial sum over its hidden
  units, all-reduced in backward) and the partial outputs leave by g (all-reduce; identity backward);
* **with sequence parallelism** each tp rank routed only its own ``T / tp`` tokens (Korthikanti et al. 2022
  §4.2.2), so the ranks' routed rows are all-gathered over tp first (padded to the longest: gloo gathers equal
  pieces; backward: reduce-scatter) and reordered expert-major, every rank computes its hidden units for all of
  them, and the partial outputs are reduce-scattered back to the rank that routed each row (backward:
  all-gather) -- Megatron's MoE token dispatcher does the same around its experts.

The second projection's bias is whole on every rank and added once, after the partial outputs are summed
(added before, it would be counted tp times). Its gradient is whole on every rank without sequence parallelism
and partial (the rank's own rows) with it, where the sequence-parallel gradient hook sums it over tp like every
weight outside the split. Each split weight carries its :class:`~shardwise.parallel.tensor.layers.TPShard`
(dim 1 of ``[E, out, in]`` for columns, dim 2 for rows), so checkpoints, the gradient norm and ZeRO treat it as
any tensor-parallel piece of the single-process tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.dist.comm.counting import CommStats, nbytes
from shardwise.dist.functional import copy_to_region, gather_rows, reduce_from_region, reduce_scatter_rows
from shardwise.model.expert_matmul import ExpertRows, batched_linear, grouped_linear
from shardwise.model.moe import ExpertLinear, Experts, moe_layers
from shardwise.parallel.tensor.layers import TPShard, even_rows, mark, replicated

COLUMN_SPLIT = ("fc_in", "gate_proj", "up_proj")
"""The experts' first projections, split by output rows (``[E, out, in]`` dim 1)."""
ROW_SPLIT = ("fc_out", "down_proj")
"""The experts' second projections, split by input columns (dim 2)."""


class RowSplitExpertLinear(ExpertLinear):
    """An :class:`ExpertLinear` holding some input columns of each expert's map: its products are partial sums,
    so it leaves its bias out (:class:`ExpertTensorParallel` adds it once the partial sums are summed)."""

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return F.linear(x, self.weight[e])

    def grouped(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        return grouped_linear(x, self.weight, None, rows)

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        return batched_linear(x, self.weight, None)


def _split_linear(child: ExpertLinear, name: str, tp: int, rank: int, sequence_parallel: bool) -> ExpertLinear:
    """This rank's piece of one stacked expert map (a new module; ``child`` is left as it is)."""
    column = name in COLUMN_SPLIT
    local = (ExpertLinear if column else RowSplitExpertLinear).__new__(ExpertLinear if column else RowSplitExpertLinear)
    nn.Module.__init__(local)
    n, d_out, d_in = child.weight.shape
    dim = 1 if column else 2
    start, stop = even_rows(d_out if column else d_in, tp, rank, f"the experts' {'output' if column else 'input'} "
                            f"width of {name}")
    info = TPShard("tp", dim, (n, d_out, d_in), start, stop)
    with torch.no_grad():
        local.weight = mark(nn.Parameter(info.take(child.weight.detach()), child.weight.requires_grad), info)
    local.bias = None
    if child.bias is not None:
        if column:
            bias_info = TPShard("tp", 1, tuple(child.bias.shape), start, stop)
            with torch.no_grad():
                local.bias = mark(nn.Parameter(bias_info.take(child.bias.detach())), bias_info)
        else:  # whole, added after the partial sums meet; partial gradient only where each rank has its own rows
            local.bias = mark(nn.Parameter(child.bias.detach().clone()),
                              replicated(child.bias, "tp", tp, rank, "sum" if sequence_parallel else None))
    return local


class ExpertTensorParallel(Experts):
    """This rank's ``d_ff / tp`` hidden units of every expert of a single-device :class:`Experts` (module
    docstring). ``forward(x, counts)`` takes and returns what the single-device module does."""

    def __init__(self, experts: Experts, group: dist.ProcessGroup, stats: CommStats | None = None,
                 sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.tp_group, self.tp_stats, self.sequence_parallel = group, stats, sequence_parallel
        self.tp, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_local, self.flavor, self.gelu = experts.n_local, experts.flavor, experts.gelu
        self.kernel, self.capability = experts.kernel, experts.capability
        d_model, d_ff = experts.widths
        self.widths = (d_model, d_ff // self.tp)
        for name, child in experts.named_children():
            setattr(self, name, _split_linear(child, name, self.tp, self.tp_rank, sequence_parallel))

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        counts = torch.as_tensor(counts, dtype=torch.int64, device=x.device)
        if self.sequence_parallel:
            y = self._gathered(x, counts)
        else:
            y = reduce_from_region(Experts.forward(self, copy_to_region(x, self.tp_group, self.tp_stats), counts),
                                   self.tp_group, self.tp_stats)
        bias = self.fc_out.bias if self.gelu is not None else None
        return y if bias is None else y + bias.to(y.dtype).index_select(0, ExpertRows(counts, x.shape[0]).expert)

    def _gathered(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sequence parallelism: every tp rank's routed rows through this rank's hidden units, the partial outputs
        summed back onto the rank that routed each row."""
        every = torch.empty(self.tp * counts.numel(), dtype=counts.dtype, device=counts.device)
        if self.tp_stats is not None:
            self.tp_stats.hand(nbytes(every), backend=True)
        dist.all_gather_single(every, counts.contiguous(), group=self.tp_group)
        every = every.view(self.tp, -1)  # every[i, e]: rows tp rank i routed to expert e
        per_rank = every.sum(1).cpu()  # the pad length and the rows: the one host synchronisation
        longest, rows = int(per_rank.max()), int(per_rank.sum())
        padded = gather_rows(F.pad(x, (0, 0, 0, longest - x.shape[0])), self.tp_group, self.tp_stats)
        starts = torch.arange(self.tp, device=every.device) * longest
        order = expert_major(every, starts, rows)  # ``padded``'s rows by expert
        y = Experts.forward(self, padded.index_select(0, order), every.sum(0))
        partial = y.new_zeros(padded.shape[0], y.shape[-1]).index_copy(0, order, y)
        return reduce_scatter_rows(partial, self.tp_group, self.tp_stats)[: x.shape[0]]

    def extra_repr(self) -> str:
        return f"hidden units {self.tp_rank + 1}/{self.tp} of every expert, sequence_parallel={self.sequence_parallel}"


def expert_major(counts: torch.Tensor, source_starts: torch.Tensor, rows: int) -> torch.Tensor:
    """Indices of rows laid out source-major -- source ``i``'s rows from ``source_starts[i]`` on, sorted by
    expert, ``counts[i, e]`` of them for expert ``e`` -- in expert-major order (expert ``e``'s rows of source 0,
    then of source 1, ...); ``rows``: ``counts.sum()``, known on the host. Computed where ``counts`` lives, with
    no host synchronisation (``repeat_interleave`` told its output size)."""
    sources, experts = counts.shape
    starts = (torch.cumsum(counts, 1) - counts + source_starts[:, None]).reshape(-1)  # of run (i, e), source-major
    runs = counts.t().reshape(-1)  # run (e, i) in expert-major order
    run = torch.repeat_interleave(torch.arange(runs.numel(), device=counts.device), runs, output_size=rows)
    first = torch.cumsum(runs, 0) - runs  # where each run begins in the expert-major order
    within = torch.arange(rows, device=counts.device) - first[run]
    source, expert = run % sources, torch.div(run, sources, rounding_mode="floor")
    return starts[source * experts + expert] + within


def apply_expert_tensor_parallel(model: nn.Module, group: dist.ProcessGroup, stats: CommStats | None = None,
                                 sequence_parallel: bool = False) -> int:
    """Split every MoE block's experts in ``model`` (holding real values) over ``group`` (``mesh.group("tp")``);
    returns how many blocks."""
    layers = moe_layers(model)
    for moe in layers:
        moe.experts = ExpertTensorParallel(moe.experts, group, stats, sequence_parallel)
    return len(layers)
