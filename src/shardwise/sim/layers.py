"""The blocking collectives inside one rank's forward and backward of each model piece, as segments.

What each technique sends per block and micro-batch is the engine's:

* tensor parallelism (Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2 for sequence parallelism):
  from the plan table (:func:`shardwise.parallel.tensor.plan.block_plan`), every ``region`` a block enters
  is an identity forward and an all-reduce backward (sequence parallel: all-gather forward, reduce-scatter
  backward), every ``rowwise`` layer an all-reduce forward (reduce-scatter forward, all-gather backward);
  a mixture-of-experts MLP stays whole (the engine skips its region). With sequence parallelism each
  parameter the plan leaves whole has its partial gradient all-reduced over tp in backward, and with
  tp > n_kv_heads the replicated key/value projections' gradients are summed too. The vocabulary-parallel
  embedding all-reduces its output (sequence parallel: reduce-scatter), the head enters the region, and
  the loss all-reduces three fp32 values per token (:mod:`shardwise.parallel.tensor.loss`). Experts split over
  tp (``parallel.etp``) add their own collectives around the experts (:meth:`LayerComm._etp_block`).
* context parallelism (:mod:`shardwise.plan.context`'s volumes): the ring passes K and V to the next rank
  cp - 1 times in forward, and K, V again plus their fp32 gradients in backward, each transfer overlapping
  one block's attention compute (Liu et al. 2023, Algorithm 1) -- only what a transfer takes beyond the
  block's compute is exposed (all of it on hardware without overlap: CPU ranks whose cores all compute);
  all-gather gathers K, V forward and reduce-scatters their gradients backward;
  Ulysses all-to-alls q, K, V and the output (Jacobs et al. 2023 §3), forward and backward.
* expert parallelism: per MoE block the split sizes and the tokens out and back by all-to-all forward, two
  all-to-alls backward (GShard, Lepikhin et al. 2021 §3.2); with an imbalance, the busiest rank's share.

With ``parallel.tp_comm_overlap`` the collectives the engine decomposes with their matmuls (each region's entry,
every row-parallel layer's exit, the head's entry) cost only what the engine's own schedules leave exposed on the
simulator's clock (:mod:`shardwise.sim.tp_overlap`).

Recomputation repeats the forward's collectives inside the backward (full: all; selective: the attention's).
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.config import Config
from shardwise.model.moe import is_moe_layer
from shardwise.model.transformer import head_dim_of
from shardwise.parallel.tensor.plan import PLANS, block_plan, style_of
from shardwise.sim.costs import RankCosts
from shardwise.sim.params import EMBED, HEAD
from shardwise.sim.tp_overlap import decomposed_exposure

Segment = tuple[str, "str | None", float]
CommFn = Callable[[str, str, float], float]
"""``comm(axis, collective, nbytes) -> seconds`` on the representative rank's groups."""


class LayerComm:
    """Segments (compute and blocking collectives) of each piece of one rank's model, per micro-batch."""

    def __init__(self, cfg: Config, costs: RankCosts, comm: CommFn, moe_imbalance: float = 1.0):
        self.cfg, self.costs, self.comm = cfg, costs, comm
        p, m = cfg.parallel, cfg.model
        self.elt = costs.roofline.scale * 4
        self.act = costs.batch * costs.tokens * m.d_model * self.elt
        self.imbalance = moe_imbalance
        self._cache: dict[tuple, list[Segment]] = {}
        self.tp, self.sp, self.cp, self.ep = p.tp, p.sequence_parallel, p.cp, p.ep
        self.overlap = costs.hw.overlap
        self.decomposed: dict[str, tuple[float, float]] | None = None
        """With tp_comm_overlap: exposed (forward, backward) seconds of each decomposed site (:mod:`.tp_overlap`)."""
        if p.tp > 1 and p.tp_comm_overlap:
            self.decomposed = decomposed_exposure(cfg, costs.roofline, costs.batch, comm, self.overlap)

    # ---- per piece -------------------------------------------------------------------------------------

    def segments(self, piece, phase: str) -> list[Segment]:
        """``phase`` F, B (the whole backward, or its input-gradient part when W is apart: "B-split") or W."""
        key = (piece if not isinstance(piece, int) else self._kind(piece), phase)
        if key not in self._cache:
            self._cache[key] = self._segments(piece, phase)
        return self._cache[key]

    def _kind(self, layer: int) -> tuple:
        """Blocks of one kind cost the same: dense or MoE, recomputed or not."""
        m, t = self.cfg.model, self.cfg.train
        return (is_moe_layer(layer, m.n_experts or 0, m.moe_every, m.moe_dense_first), t.recompute == "full" and
                layer % t.recompute_every == 0)

    def _segments(self, piece, phase: str) -> list[Segment]:
        c = self.costs
        if piece == EMBED:
            cost = c.embed()
            return self._compose(cost, phase, self._embed_comm(phase))
        if piece == HEAD:
            cost = c.head()
            return self._compose(cost, phase, self._head_comm(phase))
        cost = c.block(piece)
        return self._compose(cost, phase, self._block_comm(piece, phase))

    @staticmethod
    def _compose(cost, phase: str, comm: list[Segment]) -> list[Segment]:
        if phase == "F":
            seconds = cost.fwd.seconds
        elif phase == "W":
            return [("W", None, cost.bwd.wgrad_seconds)]
        elif phase == "B-split":
            seconds = cost.bwd.seconds - cost.bwd.wgrad_seconds
        else:
            seconds = cost.bwd.seconds
        label = "F" if phase == "F" else "B"
        return [(label, None, seconds), *comm]

    # ---- tensor parallelism --------------------------------------------------------------------------------

    def _tp(self, name: str, collective: str, nbytes: float, calls: int = 1) -> list[Segment]:
        return [(name, "tp", calls * self.comm("tp", collective, nbytes))] if calls and self.tp > 1 else []

    def _block_comm(self, layer: int, phase: str) -> list[Segment]:
        m, t = self.cfg.model, self.cfg.train
        if phase == "W":
            return []
        moe = is_moe_layer(layer, m.n_experts or 0, m.moe_every, m.moe_dense_first)
        plan = block_plan(m.flavor)
        regions = sum(1 for path, s in plan.items() if s == "region" and not (moe and path == "mlp"))
        rowwise = sum(1 for path, s in plan.items() if s == "rowwise" and not (moe and path.startswith("mlp.")))
        full = t.recompute == "full" and layer % t.recompute_every == 0
        if self.decomposed is not None:
            def tp(phase: str) -> list[Segment]:
                return self._tp_decomposed("blocks.0.", phase, skip="blocks.0.mlp." if moe else None)
        else:
            def tp(phase: str) -> list[Segment]:
                return self._tp_block(regions, rowwise, phase)
        fwd = tp("F") + self._cp_block("F") + self._ep_block(moe, "F") + \
            self._etp_block(moe, "F")
        if phase == "F":
            return fwd
        bwd = tp("B") + self._cp_block("B") + self._ep_block(moe, "B") + \
            self._etp_block(moe, "B")
        bwd += self._tp_grad_sync(layer)
        if full:
            return fwd + bwd
        if t.recompute == "selective":
            return self._cp_block("F") + bwd
        return bwd

    def _tp_block(self, regions: int, rowwise: int, phase: str) -> list[Segment]:
        if self.tp == 1:
            return []
        if not self.sp:
            n = rowwise if phase == "F" else regions
            return self._tp("tp all-reduce", "all-reduce", self.act, n)
        gathers, scatters = (regions, rowwise) if phase == "F" else (rowwise, regions)
        return self._tp("sp all-gather", "all-gather", self.act, gathers) + \
            self._tp("sp reduce-scatter", "reduce-scatter", self.act, scatters)

    def _tp_decomposed(self, prefix: str, phase: str, skip: str | None = None) -> list[Segment]:
        """The exposed part of the decomposed collectives of the sites under ``prefix`` (not under ``skip``)."""
        seconds = sum(s[0 if phase == "F" else 1] for path, s in self.decomposed.items()
                      if path.startswith(prefix) and not (skip and path.startswith(skip)))
        return [("tp decomposed (exposed)", "tp", seconds)] if seconds else []

    def _tp_grad_sync(self, layer: int) -> list[Segment]:
        """Partial gradients of the parameters the plan leaves whole (sequence parallel) and of replicated
        key/value heads, all-reduced over tp one parameter at a time in backward."""
        m = self.cfg.model
        if self.tp == 1:
            return []
        seconds = 0.0
        plan = PLANS[m.flavor]
        split = {"vocab_embedding", "colwise", "colwise_kv", "vocab_head"}
        for name, numel in self._block_param_shapes(layer):
            module, _, kind = name.rpartition(".")
            style = style_of(plan, module)
            whole = style not in split and not (style == "rowwise" and kind == "weight")
            if (whole and self.sp) or (style == "colwise_kv" and self.tp > m.n_kv_heads):
                seconds += self.comm("tp", "all-reduce", 4.0 * numel)
        return [("tp grad sync", "tp", seconds)] if seconds else []

    def _block_param_shapes(self, layer: int) -> list[tuple[str, int]]:
        key = ("shapes", self._kind(layer)[0])
        if key not in self._cache:
            import torch

            from shardwise.model.transformer import Block

            with torch.device("meta"):
                block = Block(self.cfg.model, layer)
            self._cache[key] = [(f"blocks.{layer}.{n}", p.numel()) for n, p in block.named_parameters()
                                if ".experts." not in n and ".router." not in n]
        return self._cache[key]

    def _embed_comm(self, phase: str) -> list[Segment]:
        if self.tp == 1 or phase == "W":
            return []
        if phase == "F":
            return self._tp("embedding reduce-scatter" if self.sp else "embedding all-reduce",
                            "reduce-scatter" if self.sp else "all-reduce", self.act)
        return self._tp("embedding all-gather", "all-gather", self.act) if self.sp else []

    def _head_comm(self, phase: str) -> list[Segment]:
        tokens = self.costs.batch * self.costs.tokens
        loss = [("loss all-reduce", "cp", self.comm("cp", "all-reduce", 8.0))] if self.cp > 1 and phase == "F" else []
        if self.tp == 1 or phase == "W":
            return loss
        decomposed = self.decomposed is not None and "lm_head" in self.decomposed
        if phase == "F":
            if decomposed:
                sp = self._tp_decomposed("lm_head", "F")
            else:
                sp = self._tp("head all-gather", "all-gather", self.act) if self.sp else []
            return sp + self._tp("vocab-parallel loss", "all-reduce", 4.0 * tokens, 3) + loss
        if decomposed:
            return self._tp_decomposed("lm_head", "B")
        return self._tp("head reduce-scatter" if self.sp else "head all-reduce",
                        "reduce-scatter" if self.sp else "all-reduce", self.act)

    # ---- context parallelism -------------------------------------------------------------------------------

    def _cp_block(self, phase: str) -> list[Segment]:
        if self.cp == 1:
            return []
        p, m = self.cfg.parallel, self.cfg.model
        c = self.costs
        hd = head_dim_of(m)
        heads, kv_heads = m.n_heads // self.tp, max(m.n_kv_heads // self.tp, 1)
        kv = 2 * c.batch * kv_heads * c.tokens * hd * self.elt
        core = c.core_cost()
        if p.cp_algorithm == "ring":  # each transfer hides behind one block pair's compute, where it can
            step = (core.fwd.seconds if phase == "F" else core.bwd.seconds) / self.cp
            if not self.overlap:  # the transfer takes the cores the block pair computes on: nothing hides
                step = 0.0
            send = self.comm("cp", "send-ring", kv)
            if phase == "F":
                exposed = (self.cp - 1) * max(0.0, send - step)
            else:  # K, V travel on with their gradients; the gradients take one step more home
                grads = self.comm("cp", "send-ring", kv * 4 / self.elt)
                exposed = (self.cp - 1) * max(0.0, send + grads - step) + max(0.0, grads - step)
            return [("cp ring (exposed)", "cp", exposed)]
        if p.cp_algorithm == "allgather":
            name, coll = ("cp all-gather", "all-gather") if phase == "F" else ("cp reduce-scatter", "reduce-scatter")
            return [(name, "cp", self.comm("cp", coll, self.cp * kv))]
        rep = 1 if kv_heads % self.cp == 0 else self.cp // kv_heads
        q = c.batch * heads * c.tokens * hd * self.elt
        seconds = 2 * self.comm("cp", "all-to-all", q) + self.comm("cp", "all-to-all", kv * rep)
        return [("cp all-to-all", "cp", seconds)]

    # ---- expert parallelism --------------------------------------------------------------------------------

    def _etp_block(self, moe: bool, phase: str) -> list[Segment]:
        """Experts split over tp (``parallel.etp``, :mod:`shardwise.parallel.expert.tensor`): without sequence
        parallelism f / g around them (an all-reduce of the routed rows each phase); with it the tp ranks' routed
        rows all-gathered in and the partial outputs reduce-scattered back (backward: the adjoints), plus the
        split sizes gathered forward."""
        if not moe or self.cfg.parallel.etp == 1:
            return []
        m, c = self.cfg.model, self.costs
        rows = c.batch * c.tokens * m.moe_top_k * self.imbalance * m.d_model * self.elt  # all tp ranks' rows
        if not self.sp:
            return self._tp("etp all-reduce", "all-reduce", rows)
        counts = self._tp("etp split sizes", "all-gather", 8.0 * m.n_experts * self.tp) if phase == "F" else []
        return counts + self._tp("etp all-gather", "all-gather", rows) + \
            self._tp("etp reduce-scatter", "reduce-scatter", rows)

    def _ep_block(self, moe: bool, phase: str) -> list[Segment]:
        if not moe or self.ep == 1:
            return []
        m, c = self.cfg.model, self.costs
        tokens = c.batch * c.tokens * m.moe_top_k * self.imbalance * m.d_model * self.elt
        seconds = 2 * self.comm("ep", "all-to-all", tokens)
        if phase == "F":
            seconds += self.comm("ep", "all-to-all", 8.0 * m.n_experts)
        return [("ep all-to-all", "ep", seconds)]
