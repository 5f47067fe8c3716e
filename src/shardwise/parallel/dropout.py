"""Which global slice of every dropout site a rank holds: the layout half of layout-independent dropout.

The model draws each dropout mask from a counter-based generator keyed by the element's global index
(:mod:`shardwise.model.dropout`); on one process every local index is the global one. Here the techniques
say, from outside and once, which part of each site's tensor this rank computes:

* **tokens** of the residual stream (the embedding's and the residual branches' dropout,
  :attr:`Dropout.tokens <shardwise.model.dropout.Dropout>`): context parallelism holds the head-tail
  chunks of its cp rank (:class:`~shardwise.parallel.context.layout.SequenceLayout`), and sequence
  parallelism splits those into tp contiguous pieces (Korthikanti et al. 2022 §4.2.2: the stream outside
  the tensor-parallel regions is split along the sequence);
* **heads** of the attention probabilities (:attr:`Attention.heads <shardwise.model.layers.Attention>`): tensor
  parallelism gives rank ``r`` query heads ``r H/tp .. (r+1) H/tp`` (Shoeybi et al. 2019 §3). A
  context-parallel core draws its own query and key positions (and, for Ulysses, its share of the heads);
* **layers**: a pipeline stage holds blocks whose ``layer_id`` is already global;
* **sequences**: the :class:`~shardwise.model.dropout.DropoutKey` the engine hands each forward names the
  micro-batch's first sequence in the step's global batch (this data-parallel rank's share, then the
  micro-batch within it), see :func:`replica_key`.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.model.dropout import Dropout, DropoutKey, Span


def stream_tokens(seq_len: int, cp: int = 1, cp_rank: int = 0, balance: str = "headtail", tp: int = 1,
                  tp_rank: int = 0, sequence_parallel: bool = False, device=None) -> Span:
    """The global positions of the tokens of a rank's residual stream (its cp rank's chunks, then with sequence
    parallelism its tp rank's contiguous piece of them) in a sequence of ``seq_len``."""
    from shardwise.parallel.context.layout import SequenceLayout

    if cp > 1:
        positions = SequenceLayout(cp, cp_rank, balance).positions(seq_len // cp, device=device)
    else:
        positions = torch.arange(seq_len, device=device)
    if sequence_parallel:
        positions = positions.chunk(tp)[tp_rank]
    return Span(positions, seq_len)


def attention_heads(n_heads: int, tp: int = 1, tp_rank: int = 0, device=None) -> Span:
    """The global ids of the query heads tensor-parallel rank ``tp_rank`` of ``tp`` computes."""
    per = n_heads // tp
    return Span(torch.arange(tp_rank * per, (tp_rank + 1) * per, device=device), n_heads)


def place_dropout(part: nn.Module, mesh, cfg) -> None:
    """Tell every dropout site of ``part`` (a model or a pipeline stage, after tensor and context parallelism
    rewrote it) which tokens and heads this rank holds. Nothing to do without dropout or on one process."""
    p, m = cfg.parallel, cfg.model
    tp, cp = mesh.size("tp"), mesh.size("cp")
    if not m.dropout or (cp == 1 and not p.sequence_parallel and tp == 1):
        return
    device = next((q.device for q in part.parameters() if not q.is_meta), None)  # ZeRO-3 builds on meta: the CPU
    tokens = None
    if cp > 1 or p.sequence_parallel:
        tokens = stream_tokens(cfg.data.seq_len, cp, mesh.rank("cp"), p.cp_balance, tp, mesh.rank("tp"),
                               p.sequence_parallel, device)
    heads = attention_heads(m.n_heads, tp, mesh.rank("tp"), device) if tp > 1 else None
    place_slices(part, tokens, heads)


def place_slices(part: nn.Module, tokens: Span | None, heads: Span | None) -> None:
    """Say that ``part``'s residual stream holds ``tokens`` and its attentions hold the query ``heads`` (None:
    all of them)."""
    from shardwise.model.layers import Attention

    for module in part.modules():
        if isinstance(module, Dropout) and module.site != "classifier":
            module.tokens = tokens
        elif isinstance(module, Attention):
            module.heads = heads


def replica_key(seed: int, step: int, dp_rank: int, global_batch: int, dp_size: int) -> DropoutKey:
    """The key of this data-parallel rank's share of step ``step``'s global batch: it holds sequences
    ``dp_rank * global_batch / dp_size ..`` (:meth:`~shardwise.data.DistributedWindowSampler.rank_indices`);
    a schedule shifts it to each micro-batch's first sequence."""
    return DropoutKey(seed, step, dp_rank * (global_batch // dp_size))
