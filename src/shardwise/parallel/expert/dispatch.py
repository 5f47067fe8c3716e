"""Expert parallelism: each rank of an ``ep`` group holds ``n_experts / ep`` experts; tokens travel to them
by all-to-all.

GShard (Lepikhin et al. 2021, §2.2-3.2) and Switch Transformers (Fedus et al. 2022, §2.2, Fig. 3)
place experts on different devices and move each token to its experts with an all-to-all, then
back with the reverse one; the ep group is carved out of the data-parallel ranks (torchtitan's
"dp2ep"), so each rank routes its own tokens. One MoE block's experts on this rank, step by step
(:meth:`ExpertParallel.forward`):

1. the single-device block has routed and sorted its kept slots by expert (``counts[E]``);
2. the counts are exchanged first (an all-to-all of ``E`` integers): rank ``i`` learns how many
   tokens each peer sends to each of its local experts; the splits of the next all-to-all must be known on
   the host, so they are copied there, in one copy -- the layer's one host synchronisation (the expert-major
   permutation is built on the device; :mod:`.padded` dispatches with none, padded to capacity);
3. the tokens move by an all-to-all with uneven splits (the rows for experts ``j*E/ep ..`` go to
   rank ``j``) and arrive source-major; they are permuted expert-major and each local expert runs
   one matmul over its run (:meth:`shardwise.model.moe.Experts.forward`);
4. the outputs go back by the reverse all-to-all, in the order the block sent them, and the block
   combines them with its gates. The gradient of each all-to-all is the reverse all-to-all.

The all-to-all is ours ("pairwise", :func:`shardwise.dist.comm.collectives.all_to_all_v`) unless
``comm.algorithm`` is "native" (the backend's ``all_to_all_single``); both count their bytes under the
``ep`` axis of the ledger.

Each local expert weight is its rows of the stacked single-process tensor ``[E, ...]`` and carries
``p.ep_shard`` (a :class:`~shardwise.parallel.tensor.layers.TPShard` on axis "ep", split along dim 0): the
gradient sync reduces such parameters over the ranks holding the same experts (mesh axis ``edp``)
while dense ones go over the whole data-parallel group (:mod:`shardwise.parallel.data`); the gradient
norm sums their squares over ``ep`` (:mod:`shardwise.parallel.grad_norm`); checkpoints write and load
their rows of the single-process tensor (:mod:`shardwise.parallel.expert.state`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.collectives import all_to_all, all_to_all_v
from shardwise.dist.comm.counting import CommStats
from shardwise.model.moe import Experts, moe_layers
from shardwise.parallel.expert.tensor import ExpertTensorParallel, expert_major
from shardwise.parallel.tensor.layers import ExpertRowsOfSplit, TPShard


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits[j]`` of ``x`` to rank ``j``; backward sends the gradient back the same way reversed."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, algorithm, stats, timeout_s):
        ctx.args = (out_splits, in_splits, group, algorithm, stats, timeout_s)
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        all_to_all_v(out, x.contiguous(), out_splits, in_splits, group, algorithm, timeout_s=timeout_s, stats=stats)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, algorithm, stats, timeout_s = ctx.args
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        all_to_all_v(back, grad.contiguous(), in_splits, out_splits, group, algorithm, timeout_s=timeout_s,
                     stats=stats)
        return back, None, None, None, None, None, None


def dispatch(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, algorithm: str = "pairwise",
             stats: CommStats | None = None, timeout_s: float | None = None) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0 (the combine is the same call with the splits swapped)."""
    return _AllToAll.apply(x, out_splits, in_splits, group, algorithm, stats, timeout_s)


class ExpertParallel(Experts):
    """This rank's ``E / ep`` experts of a single-device :class:`Experts`, fed by all-to-all over ``group``.

    ``forward(x, counts)`` takes the whole block's view (tokens sorted by global expert, ``counts[E]``)
    and returns the outputs in the same order, like the single-device module."""

    def __init__(self, experts: Experts, group: dist.ProcessGroup, stats: CommStats | None = None,
                 algorithm: str = "pairwise", timeout_s: float | None = None):
        nn.Module.__init__(self)
        self.group, self.stats, self.algorithm, self.timeout_s = group, stats, algorithm, timeout_s
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_experts, self.flavor, self.gelu = experts.n_local, experts.flavor, experts.gelu
        self.kernel, self.capability, self.widths = experts.kernel, experts.capability, experts.widths
        if self.n_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} does not divide model.n_experts={self.n_experts}")
        self.n_local = self.n_experts // self.ep
        start, stop = self.rank * self.n_local, (self.rank + 1) * self.n_local
        for name, child in experts.named_children():
            local = type(child).__new__(type(child))
            nn.Module.__init__(local)
            for pname, p in child.named_parameters(recurse=False):
                piece = nn.Parameter(p.detach()[start:stop].clone(), requires_grad=p.requires_grad)
                tp = getattr(p, "tp_shard", None)  # with tensor parallelism: a copy on every tp rank, or a split
                piece.ep_shard = ExpertRowsOfSplit(tp, start, stop) if tp is not None and tp.dim is not None else \
                    TPShard("ep", 0, tuple(p.shape), start, stop, owner=tp is None or tp.owner)
                for hook in (getattr(p, "_backward_hooks", None) or {}).values():
                    piece.register_hook(hook)  # sequence parallelism's sum over tp of the partial gradient
                setattr(local, pname, piece)
            if not hasattr(local, "bias"):
                local.bias = None
            setattr(self, name, local)

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        sent = torch.as_tensor(counts, dtype=torch.int64, device=x.device).contiguous()
        got = torch.empty_like(sent)  # got[i * n_local + e]: tokens rank i sends to local expert e
        all_to_all(got, sent, self.group, self.algorithm, verify=False, timeout_s=self.timeout_s, stats=self.stats)
        got = got.view(ep, n_local)
        # the uneven all-to-all needs its splits on the host: the layer's one host synchronisation (both in one copy)
        splits = torch.stack((sent.view(ep, n_local).sum(1), got.sum(1))).cpu()
        in_splits, out_splits = splits[0].tolist(), splits[1].tolist()
        arrived = dispatch(x, out_splits, in_splits, self.group, self.algorithm, self.stats, self.timeout_s)
        perm = expert_major(got, torch.cumsum(got.sum(1), 0) - got.sum(1), sum(out_splits))
        y = super().forward(arrived.index_select(0, perm), got.sum(0))  # also none
        back = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        return dispatch(y.index_select(0, back), in_splits, out_splits, self.group, self.algorithm,
                        self.stats, self.timeout_s)

    def extra_repr(self) -> str:
        start = self.rank * self.n_local
        return f"experts {start}..{start + self.n_local - 1} of {self.n_experts}, ep={self.ep}, {self.algorithm}"


class ExpertParallelTensorParallel(ExpertParallel, ExpertTensorParallel):
    """This rank's ``E / ep`` experts, each split over tp (``parallel.etp``): tokens arrive by all-to-all over ep
    (:class:`ExpertParallel`), then enter and leave the tensor-parallel split (:class:`ExpertTensorParallel`,
    next in the method order: ``ExpertParallel.forward`` calls it on the arrived rows)."""

    def __init__(self, experts: ExpertTensorParallel, group: dist.ProcessGroup, stats: CommStats | None = None,
                 algorithm: str = "pairwise", timeout_s: float | None = None):
        super().__init__(experts, group, stats, algorithm, timeout_s)
        self.tp_group, self.tp_stats, self.sequence_parallel = experts.tp_group, experts.tp_stats, \
            experts.sequence_parallel
        self.tp, self.tp_rank = experts.tp, experts.tp_rank

    def extra_repr(self) -> str:
        return f"{ExpertParallel.extra_repr(self)}; {ExpertTensorParallel.extra_repr(self)}"


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup, stats: CommStats | None = None,
                          algorithm: str = "pairwise", timeout_s: float | None = None,
                          experts_class: type[ExpertParallel] | None = None) -> nn.Module:
    """Swap every MoE block's :class:`Experts` in ``model`` (holding real values) for this rank's
    :class:`ExpertParallel` over ``group`` (``mesh.group("ep")``) -- experts already split over tp
    (:class:`ExpertTensorParallel`) keep their split; ``experts_class``: another dispatch (a subclass, e.g.
    :class:`~shardwise.parallel.expert.padded.PaddedExpertParallel`); returns ``model``."""
    for moe in moe_layers(model):
        cls = ExpertParallelTensorParallel if isinstance(moe.experts, ExpertTensorParallel) else ExpertParallel
        cls = experts_class or cls
        moe.experts = cls(moe.experts, group, stats, algorithm, timeout_s)
    return model


def all_to_all_algorithm(comm_cfg) -> str:
    """``comm.algorithm`` "native" picks the backend's all-to-all; any other value ours ("pairwise")."""
    return "native" if comm_cfg.algorithm == "native" else "pairwise"
