"""Which module of a model gets which tensor-parallel form, per flavour, and the rewrite that applies it.

The table (:data:`PLANS`) maps module paths (``fnmatch`` patterns over the single-device names) to a
style; :func:`apply_tensor_parallel` swaps each matching module for its parallel form in place, so a
plain :class:`~shardwise.model.Transformer` becomes this rank's tensor-parallel piece of it without
the model's code changing. The layout is Megatron's (Shoeybi et al. 2019, "Megatron-LM", §3, Fig. 3):

* attention: ``q_proj``, ``k_proj``, ``v_proj`` column-parallel (each rank computes n_heads / tp
  heads), ``o_proj`` row-parallel; one f at the attention's input serves all three projections;
* MLP: ``fc_in`` (GPT-2) or ``gate_proj`` and ``up_proj`` (SwiGLU) column-parallel, ``fc_out`` /
  ``down_proj`` row-parallel; one f at the MLP's input;
* token embedding vocabulary-parallel; ``lm_head`` column-parallel over the vocabulary (for GPT-2 the
  same Parameter as the embedding: the same rows, still tied), its logits consumed by the
  vocabulary-parallel cross-entropy (:mod:`shardwise.parallel.tensor.loss`), never gathered;
* position embeddings and norms replicated; a QK-norm's gain (one per head dimension, shared by the heads)
  too, its gradient summed over the ranks' heads by a hook (:data:`PER_HEAD_NORMS`).

Grouped-query attention (Ainslie et al. 2023): query head ``h`` uses key/value head
``h // (n_heads / n_kv_heads)``. With ``tp <= n_kv_heads`` rank r holds kv heads
``r * n_kv/tp .. (r+1) * n_kv/tp`` -- exactly those its query heads use. With ``tp > n_kv_heads``
(n_kv_heads must divide tp) rank r holds the one kv head ``r // (tp / n_kv_heads)``: each kv head is
replicated on the ``tp / n_kv_heads`` consecutive ranks whose query heads use it, so any tp dividing
n_heads works. Each replica's k/v gradient then covers only its own query heads; a gradient hook sums
it over the replicas (``grad_sync="replicas"``: the rank's rows are written into a zero tensor of the
full k/v weight's shape, all-reduced over the tp group, and the rank takes its rows back -- see
:class:`~shardwise.parallel.tensor.layers._SumOverReplicas`).

Sequence parallelism (Korthikanti et al. 2022, §4.2.2): the embedding's g is a reduce-scatter to
``T / tp`` tokens per rank, the regions are entered by an all-gather along the sequence and left by a
reduce-scatter; norms, dropout and residual adds run on the rank's tokens; the position table looks up
the rank's positions. The replicated parameters (norm gains and biases, row-parallel biases, the
position table) then get partial gradients, which a gradient hook registered on each of them
(:func:`~shardwise.parallel.tensor.layers.install_grad_sync`, ``grad_sync="sum"``) all-reduces over the tp
group during backward, before accumulation. The engine calls nothing for it.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.counting import CommStats
from shardwise.model.moe import MoE
from shardwise.model.transformer import head_dim_of
from shardwise.parallel.expert.tensor import ExpertTensorParallel
from shardwise.parallel.tensor.checks import check_tensor_parallel
from shardwise.parallel.tensor.layers import (
    ColumnParallelLinear,
    EnterRegion,
    RowParallelLinear,
    SequenceParallelPositions,
    TPShard,
    VocabParallelEmbedding,
    _piece,
    even_rows,
    install_grad_sync,
    mark,
    padded_rows,
    replicated,
)
from shardwise.parallel.tensor.loss import VocabParallelLoss
from shardwise.parallel.tensor.norm import SplitRMSNorm
from shardwise.parallel.tensor.overlap import OverlappedRegion

STYLES = ("vocab_embedding", "positions", "region", "colwise", "colwise_kv", "rowwise", "vocab_head", "replicate",
          "qk_norm", "qk_norm_kv")
"""The tensor-parallel forms a module can take:

* ``vocab_embedding``: :class:`VocabParallelEmbedding` (g, or the sequence reduce-scatter, at its output);
* ``positions``: a table looked up per token (learned positions, bert's token types), whole; with sequence
  parallelism :class:`SequenceParallelPositions` (the rows of the rank's tokens);
* ``region``: the module's input enters the region once (:class:`EnterRegion` forward pre-hook);
* ``colwise``: :class:`ColumnParallelLinear` inside a region (no collective of its own), an even split;
* ``colwise_kv``: the same over key/value heads, replicated where tp > n_kv_heads;
* ``rowwise``: :class:`RowParallelLinear` (g, or the sequence reduce-scatter, at its output);
* ``vocab_head``: :class:`ColumnParallelLinear` over the padded vocabulary that enters the region itself;
  tied to the vocabulary embedding where the model ties them; the model's loss becomes
  :class:`VocabParallelLoss`;
* ``replicate``: whole on every rank (norms);
* ``qk_norm`` / ``qk_norm_kv``: a QK-norm, whole on every rank when it normalises each head, else (OLMo 2's
  norm over the whole projection) split like ``q_proj`` / ``k_proj`` with its statistic summed over the ranks
  (:class:`~shardwise.parallel.tensor.norm.SplitRMSNorm`).
"""

PER_HEAD_NORMS = ("attn.q_norm.weight", "attn.k_norm.weight", "attn.q_a_proj.weight", "attn.kv_a_proj.weight",
                  "attn.kv_norm.weight")
"""Whole on every tp rank but feeding the rank's heads only: gradients summed over tp (``grad_sync="sum"``): a
per-head QK-norm's gains, latent attention's down-projections and their norms."""

_BLOCK_ATTN = {
    "blocks.*.norm1": "replicate",
    "blocks.*.attn": "region",
    "blocks.*.attn.q_proj": "colwise",
    "blocks.*.attn.k_proj": "colwise_kv",
    "blocks.*.attn.v_proj": "colwise_kv",
    "blocks.*.attn.o_proj": "rowwise",
    "blocks.*.attn.q_norm": "qk_norm",
    "blocks.*.attn.k_norm": "qk_norm_kv",
    "blocks.*.attn.q_b_proj": "colwise",  # latent attention: the up-projections split by heads
    "blocks.*.attn.kv_b_proj": "colwise",
    "blocks.*.norm2": "replicate",
    "blocks.*.mlp": "region",
}

PLANS: dict[str, dict[str, str]] = {
    "gpt2": {
        "tok_emb": "vocab_embedding",
        "pos_emb": "positions",
        **_BLOCK_ATTN,
        "blocks.*.mlp.fc_in": "colwise",
        "blocks.*.mlp.fc_out": "rowwise",
        "norm_f": "replicate",
        "lm_head": "vocab_head",
    },
    "llama": {
        "tok_emb": "vocab_embedding",
        **_BLOCK_ATTN,
        "blocks.*.mlp.gate_proj": "colwise",
        "blocks.*.mlp.up_proj": "colwise",
        "blocks.*.mlp.down_proj": "rowwise",
        "norm_f": "replicate",
        "lm_head": "vocab_head",
    },
    "bert": {  # post-norm blocks: the sub-layer's input x enters the region (its norm comes after the residual)
        "tok_emb": "vocab_embedding",
        "pos_emb": "positions",
        "type_emb": "positions",  # looked up per token, as the positions: with SP the rank's tokens' types
        **_BLOCK_ATTN,
        "blocks.*.mlp.fc_in": "colwise",
        "blocks.*.mlp.fc_out": "rowwise",
        "lm_head": "vocab_head",  # embedding norm, MLM transform, pooler, classifier: whole
    },
}
"""Per model flavour: ``{module path pattern: style}`` (see :data:`STYLES`). Patterns match the
module's canonical path (components starting with ``_``, i.e. wrappers, dropped)."""


def block_plan(flavor: str) -> dict[str, str]:
    """The entries of ``PLANS[flavor]`` for one block, relative to the block (``attn.q_proj``, ...)."""
    return {k.removeprefix("blocks.*."): v for k, v in PLANS[flavor].items() if k.startswith("blocks.*.")}


def kv_rows(n_heads: int, n_kv_heads: int, head_dim: int, tp: int, rank: int) -> tuple[int, int, int, bool]:
    """``(start, stop, replicas, owner)``: the rows of a k/v projection that rank ``rank`` of ``tp``
    holds -- the key/value heads its query heads ``rank * n_heads/tp ..`` use (see the module docstring)."""
    if n_kv_heads % tp == 0:
        per = n_kv_heads // tp
        return rank * per * head_dim, (rank + 1) * per * head_dim, 1, True
    replicas = tp // n_kv_heads
    head = rank // replicas
    return head * head_dim, (head + 1) * head_dim, replicas, rank % replicas == 0


def _canonical(path: str) -> str:
    return ".".join(p for p in path.split(".") if not p.startswith("_"))


def style_of(plan: dict[str, str], path: str) -> str | None:
    """The style ``plan`` gives the module at ``path`` (its first matching pattern), or None."""
    path = _canonical(path)
    for pattern, style in plan.items():
        if fnmatchcase(path, pattern):
            return style
    return None


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def apply_tensor_parallel(
    model: nn.Module,
    group,
    stats: CommStats | None = None,
    sequence_parallel: bool = False,
    plan: dict[str, str] | None = None,
    axis: str = "tp",
    cfg=None,
    split_experts: bool = False,
    overlap: bool = False,
) -> nn.Module:
    """Rewrite ``model`` (a plain :class:`~shardwise.model.Transformer`, or a part of one holding some of
    its modules under their usual names) in place into this rank's tensor-parallel piece over ``group``
    (``mesh.group("tp")``), and return it.

    The model must hold real values (not the meta device): each parallel layer slices the
    single-device weights. Afterwards ``model(tokens)`` returns this rank's logits over its vocabulary
    range ``[B, T, ceil(V / tp)]`` (padding columns past V are zero), and ``model(tokens, targets)``
    the mean cross-entropy (:class:`VocabParallelLoss`), the same on every rank of the group. Every
    parameter carries :class:`~shardwise.parallel.tensor.layers.TPShard` metadata (``p.tp_shard``,
    ``p.tp_axis``, ``p.shard_dim``); gradient hooks are installed where a parameter's gradient is
    partial (sequence parallelism; replicated kv heads). Collectives record into ``stats``.
    With sequence parallelism the sequence length must divide by tp.

    ``plan`` (default ``PLANS[cfg.flavor]``) and ``cfg`` (default ``model.cfg``) let the same rewrite
    apply to a single block: ``apply_tensor_parallel(block, group, plan=block_plan(cfg.flavor), cfg=cfg)``.
    A mixture-of-experts block stays whole on every rank, unless ``split_experts`` (``parallel.etp``) splits
    each expert's hidden units (:mod:`shardwise.parallel.expert.tensor`); its router stays whole.
    ``overlap`` (``parallel.tp_comm_overlap``) decomposes every region's entry with its first projection and
    every row-parallel layer's reduction with its matmul (:mod:`shardwise.parallel.tensor.overlap`).
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = model.cfg if cfg is None else cfg
    check_tensor_parallel(cfg, tp)
    plan = PLANS[cfg.flavor] if plan is None else plan
    head_dim = head_dim_of(cfg)
    sp = sequence_parallel
    split_qk_norm = getattr(cfg, "qk_norm", False) and getattr(cfg, "qk_norm_scope", "head") == "projection"
    emb: VocabParallelEmbedding | None = None
    head: ColumnParallelLinear | None = None
    regions: dict[str, OverlappedRegion] = {}
    for path, module in list(model.named_modules()):
        region = regions.get(path.rpartition(".")[0])
        style = style_of(plan, path) if path else None
        if style == "region" and isinstance(module, MoE):
            if split_experts:  # expert tensor parallelism; else whole on every tp rank (perhaps split over ep)
                module.experts = ExpertTensorParallel(module.experts, group, stats, sequence_parallel=sp)
            continue
        if style in ("qk_norm", "qk_norm_kv") and split_qk_norm:
            rows = even_rows(module.weight.shape[0], tp, rank, "q_norm") if style == "qk_norm" else \
                kv_rows(cfg.n_heads, cfg.n_kv_heads, head_dim, tp, rank)[:2]
            _set(model, path, SplitRMSNorm(module, group, stats, rows, axis))
            continue
        if style in (None, "replicate", "qk_norm", "qk_norm_kv"):
            continue
        if style == "vocab_embedding":
            emb = VocabParallelEmbedding.from_embedding(module, group, stats, sequence_parallel=sp, axis=axis)
            _set(model, path, emb)
        elif style == "positions":
            if sp:
                _set(model, path, SequenceParallelPositions.from_embedding(module, group, axis=axis))
        elif style == "region" and overlap:
            regions[path] = OverlappedRegion(group, stats, sp)
            module.register_forward_pre_hook(regions[path])
            module.register_forward_hook(regions[path].leave)
        elif style == "region":
            module.register_forward_pre_hook(EnterRegion(group, stats, sp))
        elif style == "colwise":
            _set(model, path, ColumnParallelLinear.from_linear(
                module, group, stats, sequence_parallel=sp, enter_region=False, region=region, axis=axis))
        elif style == "colwise_kv":
            start, stop, replicas, owner = kv_rows(cfg.n_heads, cfg.n_kv_heads, head_dim, tp, rank)
            _set(model, path, ColumnParallelLinear.from_linear(
                module, group, stats, sequence_parallel=sp, enter_region=False, region=region, rows=(start, stop),
                replicas=replicas, owner=owner, axis=axis))
        elif style == "rowwise":
            _set(model, path, RowParallelLinear.from_linear(module, group, stats, sequence_parallel=sp, axis=axis,
                                                            overlap=overlap))
        elif style == "vocab_head":
            start, stop, local = padded_rows(module.out_features, tp, rank)
            tied = emb is not None and getattr(cfg, "tie_embeddings", False)
            if tied:  # the embedding's rows; a bias (bert's) sliced and padded the same way
                bias = None if module.bias is None else _piece(
                    module.bias, TPShard(axis, 0, (module.out_features,), start, stop, 1, True, None), local)
                head = ColumnParallelLinear(emb.weight, bias, group, stats, sequence_parallel=sp, enter_region=True,
                                            overlap=overlap)
            else:
                head = ColumnParallelLinear.from_linear(
                    module, group, stats, sequence_parallel=sp, enter_region=True, overlap=overlap, rows=(start, stop),
                    local_rows=local, axis=axis)
            _set(model, path, head)
            # the module that owns the head computes the loss from its logits: make it vocabulary-parallel
            parent_path = path.rpartition(".")[0]
            owner = model.get_submodule(parent_path) if parent_path else model
            if not hasattr(owner, "loss_fn"):
                raise ValueError(
                    f"tensor-parallel plan: {path!r} becomes vocabulary-parallel, but its parent "
                    f"{type(owner).__name__} has no loss_fn to replace; its loss would read split logits"
                )
            owner.loss_fn = VocabParallelLoss(vocab_start=start, vocab_size=module.out_features, group=group,
                                              stats=stats)
        else:
            raise ValueError(f"tensor-parallel plan: unknown style {style!r} for {path!r}; use one of {STYLES}")
    seen: set[int] = set()
    for name, p in model.named_parameters():  # everything not split is whole on every rank
        if id(p) not in seen and getattr(p, "tp_shard", None) is None:
            # a per-head norm (QK-norm) sees only this rank's heads: its gradient is partial, like under SP
            per_head = name.endswith(PER_HEAD_NORMS)
            mark(p, replicated(p, axis, tp, rank, "sum" if sp or per_head else None))
        seen.add(id(p))
    install_grad_sync(model, group, stats)
    return model


@torch.no_grad()
def reset_parameters(model: nn.Module, seed: int) -> None:
    """Initialise a tensor-parallel model from ``(seed, canonical name, full shape)``: each parameter gets
    its rows of :func:`~shardwise.model.transformer.initial_value` of the full tensor, so it equals the
    single-process model's ``reset_parameters(seed)`` sliced. (The model's own ``reset_parameters`` would
    initialise from the local shapes.)"""
    from shardwise.model.transformer import init_kwargs, initial_value

    cfg = model.cfg
    for name, p in model.named_parameters_for_init():
        info = p.tp_shard
        full = initial_value(name, info.full_shape, seed, **init_kwargs(cfg))
        local = p.shape[info.dim] if info.dim is not None else None
        p.copy_(info.take(full, local))


__all__ = [
    "PLANS", "STYLES", "apply_tensor_parallel", "block_plan", "kv_rows", "reset_parameters",
]
