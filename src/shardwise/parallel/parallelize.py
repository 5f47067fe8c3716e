"""Apply the parallel techniques to a plain single-device model part, in one fixed order.

The order is the one in which each technique needs to see the model (torchtitan's ``parallelize``
for Llama does the same; DESIGN.md "How layouts compose"):

1. tensor / sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022 §4.2.2): the block's
   Linears and the embeddings become their parallel forms over the ``tp`` axis
   (:func:`shardwise.parallel.tensor.plan.apply_tensor_parallel`); with ``parallel.etp`` every expert's hidden
   units too (:mod:`shardwise.parallel.expert.tensor`);
2. context parallelism (Liu et al. 2023; Jacobs et al. 2023): every attention core runs over the ``cp``
   axis, positions and the loss follow the rank's share of the sequence
   (:func:`shardwise.parallel.context.apply_context_parallel`); expert parallelism over the ``ep`` axis
   (GShard, Lepikhin et al. 2021): each MoE block keeps its share of the experts and reaches them by
   all-to-all (:func:`shardwise.parallel.expert.dispatch.apply_expert_parallel`, or padded to capacity with no
   host synchronisation: :func:`shardwise.parallel.expert.padded.apply_padded_dispatch`); where a sequence's tokens
   are spread over tp (sequence parallel) or cp ranks, the MoE blocks' router losses are taken over the whole
   sequence (:func:`shardwise.parallel.expert.sequence.shard_router_losses`);
3. dropout: every dropout site learns which global tokens and heads this rank holds, so that it draws
   the masks one process draws for them (:func:`shardwise.parallel.dropout.place_dropout`);
4. activation recomputation, full or selective (:mod:`shardwise.parallel.recompute`), around what the
   previous steps produced;
5. ``torch.compile`` of each block (``train.compile``, :mod:`shardwise.parallel.compile`);

then the caller cuts pipeline stages (a pipeline builds each stage from the plain model first and
runs this function on every stage) and wraps the result in a data-parallel wrapper (plain or ZeRO)
over the gradient-reduction group. Each step runs only if its axis is on.
"""

from __future__ import annotations

from torch import nn

from shardwise.dist.comm.counting import CommLedger
from shardwise.dist.mesh import Mesh
from shardwise.parallel.compile import apply_compile
from shardwise.parallel.context import apply_context_parallel
from shardwise.parallel.dropout import place_dropout
from shardwise.parallel.expert.dispatch import all_to_all_algorithm, apply_expert_parallel
from shardwise.parallel.expert.padded import apply_padded_dispatch
from shardwise.parallel.expert.sequence import shard_router_losses
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.tensor.plan import apply_tensor_parallel


def parallelize(part: nn.Module, mesh: Mesh, cfg, ledger: CommLedger) -> nn.Module:
    """Rewrite ``part`` (a :class:`~shardwise.model.Transformer` or a pipeline stage of one, holding real
    values) in place for this rank: TP/SP -> CP -> EP -> dropout placement -> recompute -> compile.
    Collectives record into ``ledger[axis]``. Returns ``part``."""
    if mesh.size("tp") > 1:
        apply_tensor_parallel(part, mesh.group("tp"), ledger["tp"],
                              sequence_parallel=cfg.parallel.sequence_parallel, cfg=cfg.model,
                              split_experts=cfg.parallel.etp > 1, overlap=cfg.parallel.tp_comm_overlap)
    if mesh.size("cp") > 1:
        apply_context_parallel(part, mesh, cfg, ledger["cp"])
    sp = cfg.parallel.sequence_parallel and mesh.size("tp") > 1
    if sp or mesh.size("cp") > 1:  # a MoE block's router losses over the whole sequence its tokens belong to
        shard_router_losses(part, mesh.group("tp") if sp else None,
                            mesh.group("cp") if mesh.size("cp") > 1 else None, mesh.size("cp"), ledger["ep"])
    if mesh.size("ep") > 1:
        apply = apply_padded_dispatch if cfg.parallel.ep_dispatch == "padded" else apply_expert_parallel
        apply(part, mesh.group("ep"), ledger["ep"], all_to_all_algorithm(cfg.comm), cfg.comm.timeout_s or None)
    place_dropout(part, mesh, cfg)
    apply_recompute(part, cfg.train.recompute, cfg.train.recompute_every)
    if cfg.train.compile:
        apply_compile(part)
    return part
