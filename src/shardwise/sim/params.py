"""The parameters one rank holds and how the engine groups them for communication.

The model is built on the meta device, cut as the engine cuts it (a pipeline rank's
:class:`~shardwise.parallel.pipeline.partition.StageModule` chunks, or the whole ``Transformer``), and its
parameters taken in the order the data-parallel wrapper registers them (``module.parameters()``). Each gets
this rank's number of elements: the tensor-parallel slice the plan table gives its module
(:data:`shardwise.parallel.tensor.plan.PLANS`; the vocabulary padded to a multiple of tp as
:func:`~shardwise.parallel.tensor.layers.padded_rows` pads it) and the expert-parallel share of an expert
weight. The groups are then the engine's own: :func:`shardwise.parallel.data._assign_buckets` for
DataParallel's buckets and ZeRO-1/2's units (expert weights in buckets of their own), and
:func:`shardwise.parallel.zero.wrapper.block_units` for ZeRO-3's units (a root unit first, then runs of
``parallel.zero_unit`` blocks, each followed by one unit per MoE block of its experts, as the engine's
``ZeroDataParallel._expert_modules`` cuts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.config import Config
from shardwise.model.transformer import head_dim_of
from shardwise.parallel.data import _assign_buckets
from shardwise.parallel.tensor.plan import PLANS, kv_rows, style_of
from shardwise.parallel.zero.wrapper import block_units

EMBED, HEAD = "embed", "head"
FIRST_MODULES = ("tok_emb", "pos_emb", "type_emb", "emb_norm")


@dataclass
class RankParams:
    """One rank's trainable parameters (registration order), their elements here and the piece computing them."""

    names: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    pieces: list = field(default_factory=list)
    """``"embed"``, ``"head"`` or the block's layer id: whose backward produces the gradient."""
    expert: list[bool] = field(default_factory=list)
    chunk: list[int] = field(default_factory=list)
    """The rank's chunk (pipeline model chunk, 0 without a pipeline) holding the parameter."""
    late: list[bool] = field(default_factory=list)
    """Whether a pipeline changes its gradient after the flush (a chunk's ``tied_weight``: the tied table's copies
    add their gradients), so ZeRO reduces it only then (``ZeroDataParallel._late``)."""
    groups: list[list[int]] = field(default_factory=list)
    """Buckets (DataParallel, ZeRO-1/2) or units (ZeRO-3, root first) as indices into the lists above, in the
    order their collectives are issued."""

    @property
    def total(self) -> int:
        return sum(self.numels)

    def group_numel(self, g: list[int]) -> int:
        return sum(self.numels[i] for i in g)


def _local_numel(cfg: Config, name: str, p: nn.Parameter) -> int:
    m, tp, ep = cfg.model, cfg.parallel.tp, cfg.parallel.ep
    n = p.numel()
    if ".experts." in name:  # with etp each expert's hidden units over tp too, the second projection's bias whole
        split = cfg.parallel.etp > 1 and not name.endswith(("fc_out.bias", "down_proj.bias"))
        return n // ep // (tp if split else 1)
    if tp == 1:
        return n
    module, _, kind = name.rpartition(".")
    style = style_of(PLANS[m.flavor], module)
    if style in ("vocab_embedding", "vocab_head"):
        return n // p.shape[0] * -(-p.shape[0] // tp)
    if style == "colwise":
        return n // tp
    if style == "colwise_kv":
        start, stop, _, _ = kv_rows(m.n_heads, m.n_kv_heads, head_dim_of(m), tp, 0)
        return n // p.shape[0] * (stop - start)
    if style == "rowwise" and kind == "weight":
        return n // tp
    return n


def _piece(name: str):
    first = name.split(".")[0]
    if first == "blocks":
        return int(name.split(".")[1])
    return EMBED if first in FIRST_MODULES else HEAD


def meta_model(cfg: Config) -> nn.Module:
    """The whole model on the meta device (no memory), built once per simulation."""
    from shardwise.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(cfg.model)


def rank_parts(cfg: Config, model: nn.Module, stages: list[int], split: list[range]) -> list[nn.Module]:
    """The modules a rank holds: pipeline stages ``stages`` of ``split`` of the meta ``model``, or all of it."""
    from shardwise.parallel.pipeline.partition import StageModule

    if cfg.parallel.pp == 1:
        return [model]
    n = len(split)
    return [StageModule(model, s, n, split[s]) for s in stages]


def rank_params(cfg: Config, model: nn.Module, stages: list[int], split: list[range]) -> RankParams:
    """The parameters of the pipeline rank holding ``stages`` (chunk order) of the meta ``model``, and their
    buckets or units."""
    p = cfg.parallel
    parts = rank_parts(cfg, model, stages, split)
    out = RankParams()
    seen: set[int] = set()
    last = len(split) - 1
    for chunk, (part, stage) in enumerate(zip(parts, stages, strict=True)):
        tied = getattr(part, "tied_weight", None) if cfg.parallel.pp > 1 else None
        for name, param in part.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            out.names.append(name)
            out.numels.append(_local_numel(cfg, name, param))
            head_copy = name.startswith("tok_emb") and stage == last and stage != 0  # the tied table's last copy
            out.pieces.append(HEAD if head_copy else _piece(name))
            out.expert.append(p.ep > 1 and ".experts." in name)
            out.chunk.append(chunk)
            out.late.append(param is tied)
    if p.zero == 3:
        out.groups = _stage3_units(out, cfg.parallel.zero_unit)
        return out
    stand_ins = [nn.Parameter(torch.empty(n, device="meta")) for n in out.numels]
    index = {id(t): i for i, t in enumerate(stand_ins)}
    experts = {id(t) for t, e in zip(stand_ins, out.expert, strict=True) if e}
    cap = max(int(p.bucket_mb * 2**20), 1)
    buckets = _assign_buckets(stand_ins, cap, kind=lambda t: id(t) in experts)
    out.groups = [[index[id(t)] for t in b] for b in buckets]
    return out


def _stage3_units(rp: RankParams, unit_blocks: int) -> list[list[int]]:
    blocks = sorted({pc for pc in rp.pieces if isinstance(pc, int)})
    units = [[i for i, pc in enumerate(rp.pieces) if not isinstance(pc, int)]]
    for run in block_units(blocks, unit_blocks):  # each run's dense weights, then each of its blocks' experts
        units.append([i for i, pc in enumerate(rp.pieces) if pc in run and not rp.expert[i]])
        units += [g for b in run if (g := [i for i, pc in enumerate(rp.pieces) if pc == b and rp.expert[i]])]
    return units


def state_bytes(cfg: Config, rp: RankParams) -> dict[str, float]:
    """Model-state bytes on this rank by category (the engine's flat, padded units under ZeRO; fp32 parameters
    as the trainer keeps them, 16-bit flat buffers and fp32 masters with ``parallel.zero_param_dtype`` bf16)."""
    p = cfg.parallel
    shard_world = (p.dp or 1) * p.cp
    if p.zero == 0:
        flags = len(rp.names) if shard_world > 1 else 0
        return {"params": 4.0 * rp.total, "grads": 4.0 * (rp.total + flags), "master": 0.0,
                "optimizer": 8.0 * rp.total}
    elt = 2.0 if p.zero_param_dtype == "bf16" else 4.0
    padded = shard = 0
    for g in rp.groups:
        n = rp.group_numel(g)
        world = shard_world // p.ep if any(rp.expert[i] for i in g) else shard_world
        s = -(-n // world)
        shard += s
        padded += s * world
    on_device = p.offload == "none"
    return {"params": elt * (shard if p.zero == 3 else padded),
            "grads": elt * (padded if p.zero == 1 else shard),
            "master": 4.0 * shard if (elt == 2.0 and on_device) else 0.0,
            "optimizer": 8.0 * shard if on_device else 0.0}
