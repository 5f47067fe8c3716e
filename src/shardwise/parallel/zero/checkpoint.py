"""What a ZeRO rank writes into a sharded checkpoint: the slices of its own shard, nothing gathered.

Each rank owns, per unit, the pieces of parameters that fall into its slice of the flat buffer
(:class:`~shardwise.parallel.zero.flat.Piece`: elements ``[start, stop)`` of one flattened parameter).
For every piece it writes the fp32 master values -- whatever dtype the flat parameters are kept in
(``param_dtype``): they are the model, a bf16 working copy only their rounding -- under each name the
model's state dict gives that parameter (a tied weight has two), and the optimizer's element-wise
state (Adam's moments) under the parameter's index in the single-process optimizer; AdamW's scalar
``step`` is written whole by every rank holding a piece (equal everywhere). Rank 0 adds the buffers.
With disk offload each unit's master and moments are streamed in while its pieces are copied.
Loading on another layout (:mod:`shardwise.train.sharded`) assembles what the new shards need --
Rajbhandari et al. 2020 §5 keep each rank's 1/N of the state, and so does its checkpoint.
"""

from __future__ import annotations

import torch

from shardwise.train.sharded import Piece, whole


def zero_checkpoint_pieces(engine, optimizer, with_buffers: bool, ref_map=None) -> list[Piece]:
    """This rank's pieces of the model and optimizer state (``engine``: ZeroDataParallel,
    ``optimizer``: its ZeroOptimizer); ``with_buffers`` adds the non-parameter tensors (one rank);
    ``ref_map`` turns the optimizer's own parameter index into the single-process optimizer's (a
    pipeline stage holds only some parameters)."""
    live = engine.module.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for name, t in live.items():
        names.setdefault(id(t), []).append(name)
    ref_of = {id(u.params[pc.param_index]): ref for ref, u, pc, _ in optimizer._entries}
    state = optimizer.inner.state
    streamed = engine.masters.disk is not None  # disk offload: a unit's state holds values only while resident

    def snapshot(t: torch.Tensor) -> torch.Tensor:
        """``t`` for the writer: a host copy where its storage is reused once the unit leaves memory (disk
        offload), else the tensor itself, wherever it lives -- a synchronous save copies it to the host as it
        writes, and a background one copies it (from a GPU into pinned buffers on a side stream) before the next
        optimizer step may change it (train/ckpt_writer.py): the training thread copies nothing at the
        checkpoint step."""
        t = t.detach().reshape(-1) if t.dim() > 0 else t.detach()
        return t.cpu().clone() if streamed else t

    pieces: list[Piece] = []
    for u in engine.units:
        entries = [(pc, m) for uu, pc, m in engine.masters.entries if uu is u]
        if not entries:
            continue
        with engine.masters.resident(u, state):
            for pc, m in entries:
                p = u.params[pc.param_index]
                values = snapshot(m)  # the fp32 master, never the working copy's dtype
                for name in names[id(p)]:
                    pieces += _range(f"model/{name}", values, pc.start, p)
                for key, v in state.get(m, {}).items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    ref = ref_of[id(p)] if ref_map is None else ref_map(ref_of[id(p)])
                    target = f"optim/{ref}/{key}"
                    if v.dim() > 0:
                        pieces += _range(target, snapshot(v), pc.start, p)
                    else:
                        pieces.append(whole(target, v.detach().cpu().clone()))  # a step count: a copy costs nothing
    if with_buffers:
        params = {id(p) for u in engine.units for p in u.params}
        pieces += [whole(f"model/{name}", t.detach().cpu().clone()) for name, t in live.items() if id(t) not in params]
    return pieces


def _range(key: str, values: torch.Tensor, start: int, p: torch.nn.Parameter) -> list[Piece]:
    """Elements ``[start, start + n)`` of parameter ``p``'s flattened tensor as pieces of the single-process
    tensor: itself, or, for a tensor-parallel piece (``p.tp_shard``) or an expert-parallel shard (``p.ep_shard``,
    rows of the stacked experts), the full tensor's runs it covers."""
    from shardwise.parallel.tensor.state import local_range_pieces, shard_info

    info = shard_info(p)
    if info is None:
        return [Piece(key, values, start, tuple(p.shape))]

    return local_range_pieces(key, values, start, tuple(p.shape), info)


def zero_param_groups(optimizer) -> list[dict]:
    """The single-process optimizer's ``param_groups`` (hyper-parameters, parameter indices)."""
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [optimizer._ref_index[id(p)] for p in optimizer.reference_groups[gi]]}
            for gi, g in enumerate(optimizer.inner.param_groups)]
