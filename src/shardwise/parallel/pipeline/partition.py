"""Split a ``Transformer`` into pipeline stages by layers, and build only the stages a rank owns.

A stage is a contiguous run of blocks; stage 0 also holds the embedding and the last stage the final
norm and output head (GPipe, Huang et al. 2019 §2.1: "partition the network into K cells ... placed on
K accelerators"). The split is even, balanced by a per-layer cost (parameters or FLOPs, embedding and
head included) by minimising the most expensive stage (the linear-partition problem; the pipeline's
throughput is set by its slowest stage, Narayanan et al. 2019 "PipeDream" §3.1), or given by hand.

:func:`build_stage` constructs the whole model on the ``meta`` device (no memory, no initialisation),
materialises only the owned modules and initialises them with ``Transformer.reset_parameters``, which
depends only on (seed, canonical parameter name) -- so every stage holds exactly the weights of the
corresponding part of the single-device model. With tied embeddings the last stage holds its own copy
of the token table for the head; :class:`~shardwise.parallel.pipeline.executor.Pipeline` sums the two
copies' gradients (Shoeybi et al. 2019 "Megatron-LM" / Narayanan et al. 2021 §3 keep the same pair).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.model.moe import moe_aux_loss, moe_layers
from shardwise.parallel.pipeline.checks import check_boundaries, check_manual, check_stages, even_stage_sizes

if TYPE_CHECKING:
    from shardwise.config import ModelConfig

METHODS = ("even", "params", "flops")


def even_split(n_layers: int, n_stages: int, embedding_slot: bool = False, head_slot: bool = False) -> list[range]:
    """Blocks per stage as equal as possible; the first ``n_layers % n_stages`` stages get one more. With
    ``embedding_slot`` / ``head_slot`` the embedding / head count as a block of the first / last stage
    (:func:`~shardwise.parallel.pipeline.checks.even_stage_sizes`, the rule the planner and simulator share)."""
    out, start = [], 0
    for n in even_stage_sizes(n_layers, n_stages, embedding_slot, head_slot):
        out.append(range(start, start + n))
        start += n
    return out


def manual_split(n_layers: int, boundaries: Sequence[int]) -> list[range]:
    """Stages from the first block index of every stage after the first (like ``split_spec`` in
    ``torch.distributed.pipelining``): ``boundaries=[1, 3]`` on 4 blocks gives ``[0], [1, 2], [3]``."""
    edges = [0, *check_boundaries(n_layers, boundaries), n_layers]
    return [range(lo, hi) for lo, hi in pairwise(edges)]


def balanced_split(block_costs: Sequence[float], n_stages: int, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[range]:
    """Contiguous split of blocks minimising the largest stage cost, where stage 0 also pays
    ``first_extra`` (embedding) and the last stage ``last_extra`` (head). Exact dynamic programme,
    O(n_layers^2 * n_stages); ties prefer earlier, longer stages."""
    n = len(block_costs)
    check_stages(n, n_stages)
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + float(c))

    def cost(s: int, lo: int, hi: int) -> float:
        return prefix[hi] - prefix[lo] + (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: minimal max-cost of splitting blocks [0, j) into stages 0..s; arg[s][j]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    arg = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], cost(s, i, j))
                if v < best[s][j] - 1e-12 * max(1.0, abs(v)):
                    best[s][j], arg[s][j] = v, i
    out, j = [], n
    for s in range(n_stages - 1, 0, -1):
        i = arg[s][j]
        out.append(range(i, j))
        j = i
    out.append(range(0, j))
    return out[::-1]


def layer_costs(cfg: ModelConfig, method: str, seq_len: int | None = None) -> tuple[list[float], float, float]:
    """``(per-block costs, embedding cost, head cost)`` of ``cfg`` by ``method``.

    * ``"params"``: parameter counts (the head counts its weight even when tied to the embedding,
      because the last stage keeps a copy).
    * ``"flops"``: forward FLOPs per token -- 2 per matmul weight plus the attention scores and
      weighted sum, 4 * seq_len * d_model per layer (Kaplan et al. 2020 §2.1, Table 1); the embedding
      is a lookup (0 FLOPs) and the head a d_model x vocab matmul.
    """
    if method not in ("params", "flops"):
        raise ValueError(f"partition method {method!r} is not a cost; use 'params' or 'flops'")
    from shardwise.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    block_params = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    embed_params = sum(e.weight.numel() for e in (model.tok_emb, model.pos_emb) if e is not None)
    head = [getattr(model, name) for name in LAST_STAGE_MODULES if getattr(model, name, None) is not None]
    head_params = sum(p.numel() for m in head for p in m.parameters())
    if method == "params":
        return [float(n) for n in block_params], float(embed_params), float(head_params)
    t = seq_len or cfg.max_seq_len
    blocks = []
    for b in model.blocks:
        matmul = sum(m.weight.numel() for m in b.modules() if isinstance(m, nn.Linear))
        blocks.append(2.0 * matmul + 4.0 * t * cfg.d_model)
    return blocks, 0.0, 2.0 * sum(m.weight.numel() for m in head if isinstance(m, nn.Linear))


def partition(cfg: ModelConfig, n_stages: int, method: str = "even", boundaries: Sequence[int] | None = None,
              seq_len: int | None = None, embedding_slot: bool = False, head_slot: bool = False) -> list[range]:
    """The blocks of every stage: ``method`` is ``"even"`` (with the embedding's and the head's slots,
    ``parallel.pp_embedding_slot`` / ``pp_head_slot``), ``"params"``, ``"flops"``, or ``"manual"`` (with
    ``boundaries``, see :func:`manual_split`)."""
    if boundaries is not None or method == "manual":
        check_manual(cfg.n_layers, n_stages, boundaries)
        return manual_split(cfg.n_layers, boundaries)
    if method == "even":
        return even_split(cfg.n_layers, n_stages, embedding_slot, head_slot)
    if method not in METHODS:
        raise ValueError(f"partition method {method!r} is not valid; use one of {', '.join(METHODS)} or 'manual'")
    check_stages(cfg.n_layers, n_stages)
    blocks, first, last = layer_costs(cfg, method, seq_len)
    return balanced_split(blocks, n_stages, first, last)


def config_split(cfg) -> list[range]:
    """The blocks of every global stage of a resolved config's pipeline (``parallel.pp * pp_virtual`` stages,
    ``parallel.pp_partition`` and the embedding / head slots): what the engine builds and the simulator runs."""
    from shardwise.parallel.pipeline.checks import pipeline_partition

    p = cfg.parallel
    method, boundaries = pipeline_partition(p.pp_partition)
    return partition(cfg.model, p.pp * p.pp_virtual, method, boundaries, seq_len=cfg.data.seq_len,
                     embedding_slot=p.pp_embedding_slot, head_slot=p.pp_head_slot)


class StageModule(nn.Module):
    """One pipeline stage of a ``Transformer``: (embedding) -> its blocks -> (norm + head).

    Registers only owned modules, under the full model's names (``tok_emb``, ``pos_emb``,
    ``blocks.<layer_id>``, ``norm_f``, ``lm_head``), so ``named_parameters()`` here matches the
    single-device model's names. Forward runs the model's own ``embed`` and ``head`` code on the
    stage's modules (and its ``loss_fn``), so a technique that swaps them on the stage (tensor
    parallelism) is seen.
    ``forward(x, targets, dropout_key=None, tokens=None)``: ``x`` is tokens on the first stage, else
    activations; the last stage returns the loss (with ``targets``) or logits, the others activations.
    ``dropout_key``: the micro-batch's dropout draw (:mod:`shardwise.model.dropout`); ``tokens``: the
    micro-batch's input ids, from which a classifying bert stage derives the padding mask of its blocks
    (the pipeline hands them to every stage).
    """

    def __init__(self, model: nn.Module, stage: int, n_stages: int, blocks: range):
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layer_ids = list(blocks)
        object.__setattr__(self, "_model", model)  # not a child: its other modules stay on meta
        self.cfg, self.loss_fn, self.pos_emb = model.cfg, model.loss_fn, None
        self.classifies = getattr(model, "classifies", False)
        if self.is_first or (self.is_last and model.cfg.tie_embeddings and not self.classifies):
            self.tok_emb = model.tok_emb
        if self.is_first:
            for name in FIRST_STAGE_EXTRAS:  # the embedding side's other modules (bert: token types, norm)
                if getattr(model, name, None) is not None:
                    setattr(self, name, getattr(model, name))
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if self.is_last:  # the head: bert's masked-LM transform or its [CLS] classifier, or the final norm and output
            for name in LAST_STAGE_MODULES:
                if getattr(model, name, None) is not None:
                    setattr(self, name, getattr(model, name))
        for name in ("rope", "rope_local"):  # the rotations the blocks share
            if getattr(model, name, None) is not None and len(blocks):
                setattr(self, name, getattr(model, name))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, dropout_key=None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        from shardwise.model.transformer import Transformer, bert_special_ids

        padding_mask = None
        if self.classifies:  # as Transformer.forward: keys at [PAD] are masked out of attention
            ids = x if self.is_first else tokens
            if ids is None:
                raise ValueError("a classifying pipeline stage needs its micro-batch's tokens (the padding mask)")
            padding_mask = ids != bert_special_ids(self.cfg.vocab_size)[0]
        if self.is_first:
            x = Transformer.embed(self, x, dropout_key=dropout_key)
        for block in self.blocks.values():
            if padding_mask is None and dropout_key is None:
                x = block(x)
            else:
                x = block(x, padding_mask=padding_mask, dropout_key=dropout_key)
        if self.cfg.n_experts and self.training and torch.is_grad_enabled():  # as Transformer.forward
            for moe in moe_layers(self):
                moe.record()
        if not self.is_last:  # earlier stages' auxiliary losses: the executor backpropagates them
            return x
        out = Transformer.head(self, x, targets, dropout_key)
        if targets is not None and self.training and self.cfg.n_experts and (aux := moe_aux_loss(self)) is not None:
            out = out + aux.to(out.dtype)  # this stage's blocks' share, as Transformer.forward adds them all
        return out

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """The token table when the model ties it to the head and this stage holds one of its copies."""
        if self._model.cfg.tie_embeddings and not self.classifies and (self.is_first or self.is_last) \
                and self.n_stages > 1:
            return self.tok_emb.weight
        return None


class StageChunks(nn.ModuleList):
    """A pipeline rank's chunks (interleaved schedule: global stages ``c * p + rank``) as one model part.

    To the schedule it is a list (``chunks[c]`` runs chunk ``c``); to whatever reads parameter or state-dict
    names -- a data-parallel or ZeRO wrapper's units and checkpoints -- it has the single-process names each
    chunk already registers (``blocks.5.attn.qkv.weight``, not ``1.blocks.5...``): chunks hold disjoint
    blocks, and a table tied between the first and last stages never sits twice on one rank when p > 1."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen: set[int] = set()
        for chunk in self:
            for name, p in chunk.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
                if not remove_duplicate or id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        out = OrderedDict() if destination is None else destination
        for chunk in self:
            chunk.state_dict(destination=out, prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = [], set(state_dict)
        for chunk in self:
            own = chunk.state_dict().keys()
            result = chunk.load_state_dict({k: state_dict[k] for k in own if k in state_dict}, strict=False,
                                           assign=assign)
            missing += result.missing_keys
            unexpected -= set(own)
        if strict and (missing or unexpected):
            raise RuntimeError(f"state dict does not match: missing {missing[:3]}, unexpected {sorted(unexpected)[:3]}")
        return missing, sorted(unexpected)


FIRST_STAGE_EXTRAS = ("pos_emb", "type_emb", "emb_norm", "drop")
"""Modules of the model's embedding side besides the token table, held by the first stage when they exist."""
LAST_STAGE_MODULES = ("norm_f", "lm_head", "mlm_dense", "pooler", "drop_classifier", "classifier")
"""The head's modules, held by the last stage when the model has them (bert: its masked-LM transform, or the
[CLS] pooler, dropout and classifier instead of the language-model head)."""


def build_stage(cfg: ModelConfig, stage: int, n_stages: int, blocks: range, seed: int = 0,
                device: torch.device | str = "cpu") -> StageModule:
    """Build stage ``stage`` of ``n_stages`` holding ``blocks``, allocating only what it owns.

    The model is constructed on ``meta``; owned modules are moved with ``to_empty`` and initialised by
    ``Transformer.reset_parameters(seed)``, which skips meta parameters -- identical values to the
    corresponding parameters of ``Transformer(cfg)`` reset with the same seed."""
    from shardwise.model.transformer import Transformer

    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is outside 0..{n_stages - 1}")
    with torch.device("meta"):
        model = Transformer(cfg)
    owned = StageModule(model, stage, n_stages, blocks)
    owned.to_empty(device=device)
    # to_empty unties lm_head from tok_emb; reset_parameters re-ties them (both are materialised
    # on the last stage) and initialises every non-meta parameter by its canonical name.
    model.reset_parameters(seed)
    return owned
