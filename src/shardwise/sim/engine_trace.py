"""The engine's own model pieces for one rank, traced: what a micro-batch runs, operator by operator.

A one- or few-block :class:`~shardwise.model.transformer.Transformer` of the config's shape is rewritten by the
engine's own :func:`~shardwise.parallel.parallelize.parallelize` (tensor / sequence parallel swaps, the
context-parallel attention core, the experts' all-to-all dispatch) for rank 0 of the layout, on
:class:`~shardwise.sim.mirror.MirrorGroup` process groups, and its embedding, blocks and head are run forward
and backward under :func:`shardwise.sim.compute.trace`. So the operators a technique adds -- the tensor-parallel
autograd functions and the vocabulary-parallel loss, ring attention's block pairs and log-sum-exp merges, the
router, sort, index and dispatch of a mixture-of-experts block -- are costed like the model's own; the
collectives themselves are not recorded (:mod:`shardwise.sim.layers` costs them on the cluster's links).

Recomputation, ``torch.compile`` and the decomposition of tensor-parallel collectives are left out of the rewrite
(:mod:`shardwise.sim.costs` adds the recomputed forward, :mod:`shardwise.sim.tp_overlap` the decomposition).
Dense pieces are traced on the ``meta`` device (any size, no arithmetic). A mixture-of-experts block's
dispatch reads its split sizes on the host, which the meta device cannot give: it is traced with real CPU tensors
of the true shapes (random inputs: balanced routing on average) when its block and activations are small
enough to compute here (:data:`REAL_LIMIT` elements), else it is left to :mod:`shardwise.sim.costs`'s estimate.
"""

from __future__ import annotations

import dataclasses

import torch

from shardwise.config import Config
from shardwise.dist.comm.counting import CommLedger
from shardwise.dist.mesh import ParallelDims
from shardwise.model.moe import is_moe_layer
from shardwise.model.transformer import Transformer, head_dim_of
from shardwise.sim.compute import Trace, trace
from shardwise.sim.mirror import mirror_mesh

REAL_LIMIT = 1 << 26
"""Elements (parameters of the traced pieces plus one micro-batch's activations) up to which pieces are traced
on real CPU tensors (256 MB in fp32)."""


def trace_dims(cfg: Config) -> ParallelDims:
    """The smallest layout holding rank 0's tensor-, context- and expert-parallel groups of ``cfg``."""
    p = cfg.parallel
    return ParallelDims(dp=p.ep, cp=p.cp, tp=p.tp, ep=p.ep)


def _first_moe(cfg: Config) -> int | None:
    m = cfg.model
    moe = (i for i in range(m.n_layers) if is_moe_layer(i, m.n_experts or 0, m.moe_every, m.moe_dense_first))
    return next(moe, None)


def fits_here(cfg: Config, batch: int, moe: bool = False) -> bool:
    """Whether one dense block (``moe``: a mixture-of-experts block, all its experts) with the embedding and
    head, and a micro-batch's activations, stay under :data:`REAL_LIMIT` elements."""
    m = cfg.model
    d_ff = (m.moe_d_ff or m.d_ff) if moe else m.d_ff
    ffn = (m.n_experts * 3 * m.d_model * d_ff + m.moe_shared * 3 * m.d_model * m.d_ff) if moe else 3 * m.d_model * d_ff
    tokens = batch * cfg.data.seq_len // cfg.parallel.cp
    scores = batch * m.n_heads * (cfg.data.seq_len // cfg.parallel.cp) ** 2
    acts = tokens * (16 * m.d_model + 4 * d_ff * (m.moe_top_k if moe else 1) + 2 * m.vocab_size) + 4 * scores
    return 2 * m.vocab_size * m.d_model + 4 * m.d_model ** 2 + ffn + acts <= REAL_LIMIT


def engine_traces(cfg: Config, batch: int, device: str = "meta") -> dict[str, Trace]:
    """Traces of one rank's pieces for ``batch`` sequences on ``device`` ("meta" or "cpu"): "embed", "head", a
    dense "block" with its "attn", "mlp" and attention "core" (as the engine swaps it), the model's own core over
    the whole sequence with this rank's heads ("core_full", what a fused kernel would do), and a mixture-of-experts
    "moe" block when the model has one that :func:`fits_here` (on real CPU tensors, whatever ``device``)."""
    key = (repr(cfg.model), repr(cfg.parallel), cfg.data.seq_len, batch, device)
    if key not in _MEMO:
        plain = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute="none", compile=False),
                                    parallel=dataclasses.replace(cfg.parallel, tp_comm_overlap=False))
        dims = trace_dims(cfg)
        if dims.world_size == 1 and dims.ep == 1:
            traces = _traces(plain, None, batch, device)
        else:
            with mirror_mesh(dims) as mesh:
                traces = _traces(plain, mesh, batch, device)
        if len(_MEMO) >= 16:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = traces
    return _MEMO[key]


_MEMO: dict[tuple, dict[str, Trace]] = {}
"""A few recent results of :func:`engine_traces` (a pure function of its key): a calibration that simulates the
same layout many times traces it once."""


def _traces(cfg: Config, mesh, batch: int, device: str) -> dict[str, Trace]:
    from shardwise.parallel.parallelize import parallelize

    p, m = cfg.parallel, cfg.model
    tokens = cfg.data.seq_len // p.cp
    outside = tokens // p.tp if p.sequence_parallel and p.tp > 1 else tokens  # the residual stream's share
    hd = head_dim_of(m)

    def build(model_cfg, n_layers: int, on: str, engine: bool = True) -> Transformer:
        with torch.device(on):
            model = Transformer(dataclasses.replace(model_cfg, n_layers=n_layers))
        if engine and mesh is not None:
            parallelize(model, mesh, dataclasses.replace(cfg, model=model_cfg), CommLedger())
        return model

    def x(n: int, *shape: int, on: str = device) -> torch.Tensor:
        gen = torch.Generator().manual_seed(n)
        t = torch.randn(*shape, generator=gen) if on == "cpu" else torch.empty(*shape, device="meta")
        return t.requires_grad_()

    dense = dataclasses.replace(m, n_experts=0)
    model = build(dense, 1, device)
    params = list(model.parameters())
    ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    block = model.blocks[0]
    attn = block.attn
    query = attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj  # latent attention: its up-projection
    heads = query.out_features // hd
    kv = attn.k_proj.out_features // hd if hasattr(attn, "k_proj") else heads  # latent: keys expanded per head
    vd = getattr(attn, "v_dim", hd)
    out = {
        "embed": trace(lambda t: Transformer.embed(model, t), [ids], params),
        "head": trace(lambda h: Transformer.head(model, h, ids), [x(0, batch, outside, m.d_model)], params),
        "block": trace(block, [x(1, batch, outside, m.d_model)], params),
        "attn": trace(attn, [x(2, batch, outside, m.d_model)], params),
        "mlp": trace(block.mlp, [x(3, batch, outside, m.d_model)], params),
        "core": trace(attn.core, [x(4, batch, heads, tokens, hd), x(5, batch, kv, tokens, hd),
                                  x(6, batch, kv, tokens, vd)], params),
    }
    own = build(dense, 1, "meta", engine=False).blocks[0].attn  # the model's own core, on the whole sequence
    seq = cfg.data.seq_len
    out["core_full"] = trace(own.core, [x(7, batch, heads, seq, hd, on="meta"), x(8, batch, kv, seq, hd, on="meta"),
                                        x(9, batch, kv, seq, vd, on="meta")], [])
    first = _first_moe(cfg)
    if first is not None and fits_here(cfg, batch, moe=True):
        block = build(m, first + 1, "cpu").blocks[first]
        out["moe"] = trace(block, [x(10, batch, outside, m.d_model, on="cpu")], list(block.parameters()))
    return out


__all__ = ["REAL_LIMIT", "engine_traces", "fits_here", "trace_dims"]
