"""The compute of one rank's model pieces per micro-batch: blocks, embedding, head and loss, optimizer.

Each piece is the engine's own: the model's modules rewritten by the engine's parallelize steps for this rank
(:mod:`shardwise.sim.engine_trace`) and traced once per simulation (:func:`shardwise.sim.compute.trace`), so the
operators tensor, sequence, context and expert parallelism add are in it. :class:`RankCosts` turns the traces
into seconds on the cluster's roofline and applies what the trace does not run: the fused attention kernel where
the engine's core was traced as the eager reference, recomputation (the forward again inside the backward, Chen
et al. 2016; only the attention core for "selective", Korthikanti et al. 2022 §5), the busiest rank's extra
expert rows under a routing imbalance, and the estimate of a mixture-of-experts block too large to run here.
See :mod:`shardwise.sim.compute` for the approximations.
"""

from __future__ import annotations

import torch

from shardwise.config import Config, ModelConfig
from shardwise.model.layers import GeluMLP, SwiGLU
from shardwise.model.moe import is_moe_layer
from shardwise.sim.compute import FUSED_ATTENTION, BlockCost, Op, PassCost, Roofline, Trace, trace
from shardwise.sim.engine_trace import engine_traces, fits_here
from shardwise.sim.hardware import SimHardware

ADAMW_BYTES_PER_ELEMENT = 40
"""AdamW reads parameter, gradient and two moments and writes three (28 fp32 bytes per element), the
gradient norm reads the gradient (4) and clipping scales it in place (8): Loshchilov & Hutter 2019, Alg. 2."""


def mlp_trace(cfg: ModelConfig, rows: int, width: int) -> Trace:
    """The flavour's MLP of hidden ``width`` on ``rows`` tokens (a mixture-of-experts block's experts)."""
    with torch.device("meta"):
        mlp = GeluMLP(cfg.d_model, width) if cfg.flavor in ("gpt2", "bert") else SwiGLU(cfg.d_model, width)
    return trace(mlp, [_x(1, rows, cfg.d_model)], list(mlp.parameters()))


def _x(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", requires_grad=True)


class RankCosts:
    """Seconds per micro-batch of every piece one rank computes, for a resolved config on ``hw``."""

    def __init__(self, cfg: Config, hw: SimHardware, moe_imbalance: float = 1.0):
        self.cfg, self.hw = cfg, hw
        p = cfg.parallel
        self.model = cfg.model
        self.roofline = Roofline(hw, cfg.train.precision)
        self.batch, self.seq = cfg.train.micro_batch, cfg.data.seq_len
        self.tokens = self.seq // p.cp
        self.tp, self.sp, self.cp = p.tp, p.sequence_parallel, p.cp
        self.balance = 1.0 if p.cp == 1 or p.cp_balance == "headtail" else (2 * p.cp - 1) / p.cp
        self.imbalance = moe_imbalance
        self.device = "cpu" if hw.backend == "gloo" and fits_here(cfg, self.batch) else "meta"
        """Where the pieces are traced: the CPU's own code paths (the ring's fused blocks) on a CPU cluster when
        they are small enough to run here, else the meta device."""
        self._blocks: dict[tuple, BlockCost] = {}
        self._traces: dict[tuple, object] = {}
        self._core: BlockCost | None = None
        self._core_inputs = 0.0

    @property
    def traces(self) -> dict[str, Trace]:
        """The engine's pieces of this rank, traced once (:func:`~shardwise.sim.engine_trace.engine_traces`)."""
        if "engine" not in self._traces:
            self._traces["engine"] = engine_traces(self.cfg, self.batch, self.device)
        return self._traces["engine"]

    def _traced(self, fn, *args):
        """``fn(model, *args)``, traced once per simulation."""
        key = (fn.__name__, *args)
        if key not in self._traces:
            self._traces[key] = fn(self.model, *args)
        return self._traces[key]

    def block(self, layer_id: int) -> BlockCost:
        """One block's forward and backward for one micro-batch (with recomputation in the backward)."""
        m, t = self.model, self.cfg.train
        moe = is_moe_layer(layer_id, m.n_experts or 0, m.moe_every, m.moe_dense_first)
        full = t.recompute == "full" and layer_id % t.recompute_every == 0
        key = (moe, full)
        if key not in self._blocks:
            self._blocks[key] = self._block(moe, full)
        return self._blocks[key]

    def _block(self, moe: bool, full: bool) -> BlockCost:
        rl, m, tr = self.roofline, self.model, self.traces
        out = rl.block_cost(tr["moe"] if moe and "moe" in tr else tr["block"])
        if moe and "moe" not in tr:  # too large to run here: the dense block with its MLP replaced by the experts'
            out = out - rl.block_cost(tr["mlp"]) + self._moe_estimate(self.imbalance)
        elif moe and self.imbalance > 1:  # the busiest rank's experts run the extra rows
            out = out + rl.block_cost(self._traced(mlp_trace, self._routed(self.imbalance - 1), self._d_expert))
        core_here = rl.block_cost(tr["core"])
        core = core_here
        if self.hw.attention == "flash" and not any(op.name in FUSED_ATTENTION for op in tr["core"].fwd):
            # the engine's core was traced as the eager reference: cost it as the fused kernel instead
            f, b, act = rl.flash(tr["core_full"], m.flavor != "bert", self.balance / self.cp)
            core = BlockCost(f, b, act)
            out = out - core_here + core
        self._core = core
        self._core_inputs = 0.75 * tr["core"].io_bytes * self.balance * rl.scale  # q, k, v of (q, k, v, o)
        t = self.cfg.train
        if full:  # the block's input is kept; its forward runs again before its backward
            act = self.batch * self.tokens * m.d_model * 4 * rl.scale / (self.tp if self.sp else 1)
            return BlockCost(out.fwd, out.bwd + out.fwd, act)
        if t.recompute == "selective":  # the attention core's forward again; only its inputs kept
            return BlockCost(out.fwd, out.bwd + core.fwd, out.act_bytes - core.act_bytes + self._core_inputs)
        return out

    @property
    def _d_expert(self) -> int:
        return self.model.moe_d_ff or self.model.d_ff

    def _routed(self, share: float) -> int:
        return max(round(self.batch * self.tokens * self.model.moe_top_k * share), 1)

    def _moe_estimate(self, imbalance: float) -> BlockCost:
        """A mixture-of-experts feed-forward too large to trace here: the flavour's MLP over the rows this rank's
        experts process with balanced routing (times ``imbalance``), the router as one projection, the shared
        experts as one MLP."""
        rl, m = self.roofline, self.model
        rows = self.batch * self.tokens
        mlp = rl.block_cost(self._traced(mlp_trace, self._routed(imbalance), self._d_expert)) + \
            BlockCost(rl.pass_cost(_router_ops(rows, m)), rl.pass_cost(_router_ops(rows, m, backward=True)), 0.0)
        if m.moe_shared:
            mlp = mlp + rl.block_cost(self._traced(mlp_trace, rows, m.moe_shared * self._d_expert))
        return mlp

    def core_cost(self) -> BlockCost:
        """The attention core of one block on this rank (its share under context parallelism)."""
        if self._core is None:
            self.block(0)
        return self._core

    def embed(self) -> BlockCost:
        return self.roofline.block_cost(self.traces["embed"])

    def head(self) -> BlockCost:
        return self.roofline.block_cost(self.traces["head"])

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


def routing_imbalance(records: list[dict], ep: int, first_step: int = 1) -> float:
    """The busiest expert rank's routed tokens over the mean rank's, from a run's ``metrics.jsonl`` records
    (``moe_load_layer{i}``: the tokens routed to each expert in the step), averaged over the steps from
    ``first_step`` and the mixture-of-experts blocks -- what :class:`RankCosts` takes as ``moe_imbalance``.

    Rank j of an ep group holds experts ``j E/ep .. (j+1) E/ep - 1`` (``parallel/expert/dispatch.py``). The
    all-to-alls meet in every block, so a step waits for each block's busiest rank: the mean of the per-block
    ratios, not the ratio of the sums. 1.0 where the run has no expert loads or ``ep`` is 1."""
    ratios = []
    for r in records:
        if r.get("step", 0) < first_step:
            continue
        for key, load in r.items():
            if not key.startswith("moe_load_layer") or ep < 2 or sum(load) == 0:
                continue
            per_rank = [sum(load[j * len(load) // ep:(j + 1) * len(load) // ep]) for j in range(ep)]
            ratios.append(max(per_rank) * ep / sum(per_rank))
    return sum(ratios) / len(ratios) if ratios else 1.0


__all__ = ["RankCosts", "BlockCost", "PassCost", "mlp_trace", "routing_imbalance"]

