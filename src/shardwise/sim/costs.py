"""The compute of one rank's model pieces per micro-batch: blocks, embedding, head and loss, optimizer.

Each piece is the model's own module built on the meta device with this rank's tensor-parallel shapes
(:mod:`shardwise.parallel.tensor.plan`'s table) and traced once per distinct shape
(:func:`shardwise.sim.compute.trace`); :class:`RankCosts` turns the traces into seconds on the cluster's
roofline and applies what the layout changes: the fused attention kernel, context parallelism's share of
the attention, sequence parallelism's share of the norms, recomputation (the forward again inside the
backward, Chen et al. 2016; only the attention core for "selective", Korthikanti et al. 2022 §5), and the
mixture-of-experts MLP. See :mod:`shardwise.sim.compute` for the approximations.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shardwise.config import Config, ModelConfig
from shardwise.model.layers import GeluMLP, RotaryEmbedding, SwiGLU
from shardwise.model.moe import is_moe_layer
from shardwise.model.transformer import Block, Transformer
from shardwise.parallel.tensor.plan import block_plan, kv_rows
from shardwise.sim.compute import BlockCost, Op, PassCost, Roofline, Trace, trace
from shardwise.sim.hardware import SimHardware

ADAMW_BYTES_PER_ELEMENT = 40
"""AdamW reads parameter, gradient and two moments and writes three (28 fp32 bytes per element), the
gradient norm reads the gradient (4) and clipping scales it in place (8): Loshchilov & Hutter 2019, Alg. 2."""


def _sliced(block: nn.Module, cfg: ModelConfig, tp: int) -> nn.Module:
    """``block`` with each projection replaced by the slice tensor-parallel rank 0 holds (on meta)."""
    if tp == 1:
        return block
    head_dim = cfg.d_model // cfg.n_heads
    for path, style in block_plan(cfg.flavor).items():
        try:
            lin = block.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(lin, nn.Linear):
            continue
        i, o, bias = lin.in_features, lin.out_features, lin.bias is not None
        if style == "colwise":
            new = nn.Linear(i, o // tp, bias=bias, device="meta")
        elif style == "colwise_kv":
            start, stop, _, _ = kv_rows(cfg.n_heads, cfg.n_kv_heads, head_dim, tp, 0)
            new = nn.Linear(i, stop - start, bias=bias, device="meta")
        elif style == "rowwise":
            new = nn.Linear(i // tp, o, bias=bias, device="meta")
        else:
            continue
        parent, _, child = path.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, child, new)
    return block


def _x(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", requires_grad=True)


def block_traces(cfg: ModelConfig, batch: int, tokens: int, tp: int) -> dict[str, Trace]:
    """Traces of a dense block on ``tokens`` tokens per sequence: the whole block, its attention and MLP
    regions, and the attention core."""
    dense = dataclasses.replace(cfg, n_experts=0)
    with torch.device("meta"):
        rope = None if cfg.flavor in ("gpt2", "bert") else RotaryEmbedding(cfg.d_model // cfg.n_heads, cfg.max_seq_len,
                                                                               cfg.rope_theta)
        block = _sliced(Block(dense, 0, rope), dense, tp)
    params = list(block.parameters())
    d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
    heads = block.attn.q_proj.out_features // hd
    kv = block.attn.k_proj.out_features // hd
    return {
        "block": trace(block, [_x(batch, tokens, d)], params),
        "attn": trace(block.attn, [_x(batch, tokens, d)], params),
        "mlp": trace(block.mlp, [_x(batch, tokens, d)], params),
        "core": trace(block.attn.core, [_x(batch, heads, tokens, hd), _x(batch, kv, tokens, hd),
                                        _x(batch, kv, tokens, hd)], params),
    }


def mlp_trace(cfg: ModelConfig, rows: int, width: int) -> Trace:
    """The flavour's MLP of hidden ``width`` on ``rows`` tokens (a mixture-of-experts block's experts)."""
    with torch.device("meta"):
        mlp = GeluMLP(cfg.d_model, width) if cfg.flavor in ("gpt2", "bert") else SwiGLU(cfg.d_model, width)
    return trace(mlp, [_x(1, rows, cfg.d_model)], list(mlp.parameters()))


def end_traces(cfg: ModelConfig, batch: int, tokens: int, tp: int) -> dict[str, Trace]:
    """The embedding (``Transformer.embed``) and the head with its loss (``Transformer.head``), vocabulary split."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg, n_layers=1))
        if tp > 1:
            rows = -(-cfg.vocab_size // tp)
            model.tok_emb = nn.Embedding(rows, cfg.d_model)
            model.lm_head = nn.Linear(cfg.d_model, rows, bias=model.lm_head.bias is not None)
    params = list(model.parameters())
    tokens_in = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    targets = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    return {"embed": trace(lambda t: Transformer.embed(model, t), [tokens_in], params),
            "head": trace(lambda x: Transformer.head(model, x, targets), [_x(batch, tokens, cfg.d_model)], params)}


class RankCosts:
    """Seconds per micro-batch of every piece one rank computes, for a resolved config on ``hw``."""

    def __init__(self, cfg: Config, hw: SimHardware, moe_imbalance: float = 1.0):
        self.cfg, self.hw = cfg, hw
        p, t = cfg.parallel, cfg.train
        self.model = cfg.model
        self.roofline = Roofline(hw, t.precision)
        self.batch, self.seq = t.micro_batch, cfg.data.seq_len
        self.tokens = self.seq // p.cp
        self.tp, self.sp, self.cp = p.tp, p.sequence_parallel, p.cp
        self.balance = 1.0 if p.cp == 1 or p.cp_balance == "headtail" else (2 * p.cp - 1) / p.cp
        self.imbalance = moe_imbalance
        self._blocks: dict[tuple, BlockCost] = {}
        self._traces: dict[tuple, object] = {}
        self._core: BlockCost | None = None
        self._core_inputs = 0.0

    def _traced(self, fn, *args):
        """``fn(model, *args)``, traced once per simulation."""
        key = (fn.__name__, *args)
        if key not in self._traces:
            self._traces[key] = fn(self.model, *args)
        return self._traces[key]

    def block(self, layer_id: int) -> BlockCost:
        """One block's forward and backward for one micro-batch (with recomputation in the backward)."""
        m, t = self.model, self.cfg.train
        moe = is_moe_layer(layer_id, m.n_experts or 0, m.moe_every)
        full = t.recompute == "full" and layer_id % t.recompute_every == 0
        key = (moe, full)
        if key not in self._blocks:
            self._blocks[key] = self._block(moe, full)
        return self._blocks[key]

    def _block(self, moe: bool, full: bool) -> BlockCost:
        rl, m = self.roofline, self.model
        tr = self._traced(block_traces, self.batch, self.tokens, self.tp)
        whole, attn, mlp = rl.block_cost(tr["block"]), rl.block_cost(tr["attn"]), rl.block_cost(tr["mlp"])
        core_here = rl.block_cost(tr["core"])
        causal = m.flavor != "bert"
        share = self.balance / self.cp
        full_core = self._traced(block_traces, self.batch, self.seq, self.tp)["core"] if self.cp > 1 else tr["core"]
        if self.hw.attention == "flash":
            f, b, act = rl.flash(full_core, causal, share)
            core = BlockCost(f, b, act)
        else:
            core = rl.block_cost(full_core).scaled(share)
        rest = whole - attn - mlp
        if self.sp:
            rest = rest.scaled(1.0 / self.tp)
        if moe:
            rows = self.batch * self.tokens
            routed = rows * m.moe_top_k * self.imbalance
            mlp = rl.block_cost(self._traced(mlp_trace, round(routed), m.d_ff)) + \
                BlockCost(rl.pass_cost(_router_ops(rows, m)), rl.pass_cost(_router_ops(rows, m, backward=True)), 0.0)
            if m.moe_shared:
                mlp = mlp + rl.block_cost(self._traced(mlp_trace, rows, m.moe_shared * m.d_ff))
        self._core = core
        self._core_inputs = 0.75 * full_core.io_bytes * share * rl.scale  # q, k, v of (q, k, v, o)
        out = (attn - core_here + core) + mlp + rest
        t = self.cfg.train
        if full:  # the block's input is kept; its forward runs again before its backward
            act = self.batch * self.tokens * m.d_model * 4 * rl.scale / (self.tp if self.sp else 1)
            return BlockCost(out.fwd, out.bwd + out.fwd, act)
        if t.recompute == "selective":  # the attention core's forward again; only its inputs kept
            return BlockCost(out.fwd, out.bwd + core.fwd, out.act_bytes - core.act_bytes + self._core_inputs)
        return out

    def core_cost(self) -> BlockCost:
        """The attention core of one block on this rank (its share under context parallelism)."""
        if self._core is None:
            self.block(0)
        return self._core

    def embed(self) -> BlockCost:
        return self.roofline.block_cost(self._traced(end_traces, self.batch, self.tokens, self.tp)["embed"])

    def head(self) -> BlockCost:
        return self.roofline.block_cost(self._traced(end_traces, self.batch, self.tokens, self.tp)["head"])

    def optimizer_seconds(self, elements: float, tensors: int) -> float:
        """AdamW, the gradient norm and clipping over ``elements`` fp32 elements in ``tensors`` tensors
        (memory-bound; a few kernels per tensor, as the foreach implementations launch)."""
        hw = self.hw
        memory = elements * ADAMW_BYTES_PER_ELEMENT / (hw.hbm_bw * hw.memory_efficiency)
        return memory + 4 * tensors * hw.kernel_overhead


def _router_ops(rows: int, m: ModelConfig, backward: bool = False) -> list[Op]:
    """The router's projection (and, backward, its two gradient products) as operators."""
    mm = Op("mm", 2.0 * rows * m.d_model * m.n_experts, 4.0 * (rows * m.d_model + m.d_model * m.n_experts
                                                                + rows * m.n_experts))
    return [mm, Op("mm", mm.flops, mm.bytes, True)] if backward else [mm]


__all__ = ["RankCosts", "BlockCost", "PassCost", "block_traces", "end_traces", "mlp_trace"]
