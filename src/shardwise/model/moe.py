"""Mixture-of-experts feed-forward block, as plain single-device code.

A router scores each token against ``E`` experts; the token goes to its ``k`` best experts and the
block's output is the sum of those experts' outputs weighted by their router probabilities
(Shazeer et al. 2017, "Outrageously Large Neural Networks", §2; Fedus et al. 2022, "Switch
Transformers", eq. 1-2; Jiang et al. 2024, "Mixtral of Experts", §2.1). Experts are the flavour's
MLP (GELU for gpt2, exact GELU for bert, SwiGLU for llama); ``shared`` experts, which every token passes
through, are one MLP ``n_shared`` times as wide as a routed expert (Dai et al. 2024, "DeepSeekMoE", §3.2:
shared experts concatenated).

Routing, exactly (:func:`assign`): the router (:mod:`shardwise.model.router`: ``softmax``, ``softmax_renorm``
or ``sigmoid_bias``) gives each token its k experts in order of preference and their gates; then

* a token's k choices are *slots*; slots are ordered choice-major (every token's first choice,
  in token order, then every second choice, ...), so first choices have priority (GShard, Lepikhin
  et al. 2021, §2.2, Algorithm 1);
* capacity ``C = ceil(cf * k * N / E)`` for ``N`` tokens (Switch §2.2, "expert capacity"); a slot
  whose position among the earlier slots of its expert is ``>= C`` is dropped (contributes zero; the
  token keeps its residual). ``cf = 0``: no capacity, nothing dropped ("dropless", Gale et al. 2023,
  "MegaBlocks").

Auxiliary losses, added to the training loss by the model (``Transformer.forward``, training mode):

* load balancing (Switch eq. 4): ``aux_coeff * E * sum_i f_i P_i`` with ``f_i`` the fraction of slots
  routed to expert ``i`` (before drops; ``sum f = 1``) and ``P_i`` the mean router probability of ``i``;
  uniform routing gives exactly ``aux_coeff``;
* router z-loss (Zoph et al. 2022, "ST-MoE", eq. 5): ``z_coeff * mean_n (log sum_j exp z_nj)^2``.

Experts compute *expert-major*: the kept slots are sorted by expert, each expert runs one matmul on
its contiguous run of tokens (:meth:`Experts.forward` takes the tokens and the count per expert), and
the outputs are scattered back weighted by the gates (:func:`combine`). Expert parallelism replaces
``Experts`` from outside (:mod:`shardwise.parallel.expert.dispatch`) by one that moves the runs by all-to-all.

Expert weights are stacked ``[E, out, in]`` tensors (``experts.fc_in.weight``...), initialised from
(seed, name, full shape) like every parameter, so a rank holding experts ``a..b`` slices them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.model.expert_matmul import (
    KERNELS,
    Capability,
    ExpertRows,
    batched_linear,
    dense_grad,
    grouped_linear,
    pick,
)
from shardwise.model.layers import GeluMLP, SwiGLU
from shardwise.model.router import Router


def capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int | None:
    """Slots each expert keeps: ``ceil(factor * top_k * n_tokens / n_experts)`` (Switch §2.2); ``None``
    (unbounded) for ``factor == 0``. E.g. 16 tokens, k=2, E=8: 4 at factor 1, 5 at 1.25."""
    if factor <= 0:
        return None
    return math.ceil(factor * top_k * n_tokens / n_experts)


def is_moe_layer(layer_id: int, n_experts: int, every: int, dense_first: int = 0) -> bool:
    """Whether block ``layer_id`` has an MoE feed-forward: every ``every``-th block, the last of each run
    (``every=2``: blocks 1, 3, 5, ... as in GShard's every-other-layer placement), past the first ``dense_first``
    blocks, which stay dense (DeepSeek-V3's ``first_k_dense_replace``, DeepSeek-AI 2024 §4.2)."""
    return n_experts > 0 and layer_id >= dense_first and layer_id % every == every - 1


class ExpertLinear(nn.Module):
    """``E`` independent linear maps in one tensor: ``weight [E, out, in]``, ``bias [E, out]``."""

    def __init__(self, n: int, d_in: int, d_out: int, *, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in))
        self.bias = nn.Parameter(torch.empty(n, d_out)) if bias else None

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e`` alone on its rows ``x``."""
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])

    def grouped(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """Every expert on its run of the expert-sorted rows ``x``, in one grouped GEMM."""
        return grouped_linear(x, self.weight, self.bias, rows)

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on its padded rows ``x [E, C, in]``, in one batched matmul."""
        return batched_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        n, out, d_in = self.weight.shape
        return f"experts={n}, in={d_in}, out={out}, bias={self.bias is not None}"


class Experts(nn.Module):
    """``n`` feed-forward experts of the flavour's kind, run expert-major on sorted tokens.

    ``kernel`` (:data:`~shardwise.model.expert_matmul.KERNELS`): how the experts' matmuls run -- ``auto`` (one
    grouped GEMM where the device offers it, else a padded batched matmul when the load is even, else a loop
    over experts; :mod:`shardwise.model.expert_matmul`), or one of them by name."""

    def __init__(self, n: int, d_model: int, d_ff: int, flavor: str, kernel: str = "auto"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"expert kernel {kernel!r} is not valid; use one of {', '.join(KERNELS)}")
        self.n_local, self.flavor, self.kernel, self.widths = n, flavor, kernel, (d_model, d_ff)
        self.capability = Capability()
        self.gelu = {"gpt2": "tanh", "bert": "none"}.get(flavor)
        """The GELU of a GELU-MLP flavour (gpt2's tanh approximation, bert's exact erf), or None: SwiGLU."""
        if self.gelu is not None:
            self.fc_in = ExpertLinear(n, d_model, d_ff, bias=True)
            self.fc_out = ExpertLinear(n, d_ff, d_model, bias=True)
        else:
            self.gate_proj = ExpertLinear(n, d_model, d_ff, bias=False)
            self.up_proj = ExpertLinear(n, d_model, d_ff, bias=False)
            self.down_proj = ExpertLinear(n, d_ff, d_model, bias=False)

    def mlp(self, x: torch.Tensor, linear) -> torch.Tensor:
        """The flavour's MLP on ``x`` with ``linear(layer, h)`` applying one :class:`ExpertLinear`."""
        if self.gelu is not None:
            return linear(self.fc_out, F.gelu(linear(self.fc_in, x), approximate=self.gelu))
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` (a local index) on tokens ``x [n, d_model]``."""
        return self.mlp(x, lambda layer, h: layer(h, e))

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """Tokens ``x`` sorted by expert, ``counts[e]`` of them for expert ``e`` (a tensor on ``x``'s device: the
        grouped kernel then never waits for the host): the outputs in the same order. Every expert runs, on no
        tokens too, so every weight is in the graph whatever the routing: its gradient (zero) and the hooks on
        it come in every backward."""
        if not torch.is_tensor(counts):
            counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
        rows = ExpertRows(counts, x.shape[0])
        kernel = pick(self.kernel, self.capability, x, rows, self.widths)
        if kernel == "grouped":
            y = self.mlp(x, lambda layer, h: layer.grouped(h, rows))
        elif kernel == "padded":
            y = rows.unpad(self.mlp(rows.pad(x), lambda layer, h: layer.batched(h)))
        else:
            y = torch.cat([self.expert(e, chunk) for e, chunk in enumerate(x.split(counts.tolist()))])
        return dense_grad(y)


@dataclass
class Routing:
    """Where each kept slot goes, in expert-major order (every tensor ``[kept slots]`` unless said)."""

    token: torch.Tensor
    """The token (row of the flattened input) of each kept slot, sorted by expert."""
    gate: torch.Tensor
    """Its gate (router probability), in the same order."""
    counts: torch.Tensor
    """``[E]``: kept slots per expert."""
    routed: torch.Tensor
    """``[E]``: slots the router sent to each expert before the capacity drops."""
    dropped: int | torch.Tensor
    """Slots dropped by the capacity (a tensor where the slots were assigned without reading the device:
    :func:`shardwise.parallel.expert.padded.padded_slots`)."""


def route(probs: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Switch routing of ``probs [N, E]``: the top-k experts, gated by their probabilities (:func:`assign`)."""
    gates, experts = probs.topk(top_k, dim=-1)
    return assign(experts, gates, probs.shape[1], capacity_factor)


def count_per_expert(expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``[E]`` int64: how many entries of ``expert`` name each expert (``bincount`` of a known length, by a
    scatter-add: ``bincount``'s length depends on the data, so it reads the maximum on the host)."""
    return torch.zeros(n_experts, dtype=torch.int64, device=expert.device).index_add_(
        0, expert, torch.ones_like(expert))


def assign(experts: torch.Tensor, gates: torch.Tensor, n_experts: int, capacity_factor: float) -> Routing:
    """The slots of each token's choices ``experts [N, k]`` (gates ``[N, k]``) with capacity drops, exactly as the
    module docstring says."""
    n, top_k = experts.shape
    e = n_experts
    slot_expert = experts.t().reshape(-1)  # choice-major: slot j*N + t
    slot_gate = gates.t().reshape(-1)
    slot_token = torch.arange(n, device=experts.device).repeat(top_k)
    routed = count_per_expert(slot_expert, e)
    cap = capacity(n, top_k, e, capacity_factor)
    if cap is not None:
        onehot = F.one_hot(slot_expert, e)
        position = (onehot.cumsum(0) - 1).gather(1, slot_expert[:, None]).squeeze(1)
        keep = position < cap
        slot_expert, slot_gate, slot_token = slot_expert[keep], slot_gate[keep], slot_token[keep]
    order = torch.sort(slot_expert, stable=True).indices
    counts = count_per_expert(slot_expert, e)
    return Routing(slot_token[order], slot_gate[order], counts, routed, int(n * top_k - slot_expert.numel()))


def combine(y: torch.Tensor, routing: Routing, n_tokens: int) -> torch.Tensor:
    """Scatter the experts' outputs ``y`` (expert-major, one row per kept slot) back to ``[N, d]``,
    each weighted by its gate and summed over the token's slots."""
    weighted = y * routing.gate[:, None].to(y.dtype)
    return y.new_zeros(n_tokens, y.shape[-1]).index_add(0, routing.token, weighted)


def load_balancing_loss(probs: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """Switch Transformer eq. 4 without its coefficient: ``E * sum_i f_i P_i``; ``f_i = routed_i / sum routed``
    (a constant), ``P_i`` the mean of ``probs [N, E]`` over tokens."""
    e = probs.shape[-1]
    f = routed.to(probs.dtype) / routed.sum().clamp(min=1)
    return e * (f * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE eq. 5 without its coefficient: the mean over tokens of ``(log sum_j exp z_j)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


class MoEStats:
    """Per-step sums of what the router did (training forwards only), popped once per step. Every field is a
    sum, so the sums of several ranks' tokens (data-, context-parallel) add up to the global batch's. The sums
    stay on the router's device: neither a forward nor :func:`pop_moe_totals` waits for it."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.reset()

    def reset(self) -> None:
        self.sums: torch.Tensor | None = None
        """``[3, E]`` fp64 on the router's device: per expert the slots it computed (after capacity drops), the
        slots the router sent it (before drops: the load, Switch's ``f_i`` times the slots) and its router
        probability summed over tokens (Switch's ``P_i`` times the tokens); ``None`` before the first forward."""
        self.tokens = 0
        self.aux: list[torch.Tensor] = []
        self.z: list[torch.Tensor] = []

    @property
    def calls(self) -> int:
        return len(self.aux)

    def add(self, routing: Routing, probs: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        step = torch.stack([routing.counts.detach().double(), routing.routed.detach().double(),
                            probs.detach().double().sum(0)])
        self.sums = step if self.sums is None else self.sums + step
        self.tokens += probs.shape[0]
        self.aux.append(aux.detach())
        self.z.append(z.detach())


class MoE(nn.Module):
    """Mixture-of-experts feed-forward: router, ``n_experts`` routed experts, optional shared experts.

    ``forward(x [B, T, d]) -> [B, T, d]``. After a forward, ``self.aux_loss`` holds the weighted sum
    of the load-balancing and z losses of that forward (a scalar with a graph), and ``self.last``
    the routing, the balance probabilities and the two unweighted losses, for the model to add and record.
    ``layer_id``: the block's index in the model (it names the block's load in the metrics);
    ``d_expert``: each routed (and shared) expert's inner size (default ``d_ff``); ``groups``, ``group_top_k``,
    ``gate_scale``: the router's (:class:`~shardwise.model.router.Router`).
    """

    def __init__(self, d_model: int, d_ff: int, flavor: str, n_experts: int, top_k: int, *, n_shared: int = 0,
                 capacity_factor: float = 0.0, aux_coeff: float = 0.0, z_coeff: float = 0.0,
                 router: str = "softmax", bias_rate: float = 0.0, layer_id: int = 0, d_expert: int | None = None,
                 groups: int = 1, group_top_k: int = 1, gate_scale: float = 1.0):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"model.moe_top_k={top_k} must be in 1..model.n_experts={n_experts}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_coeff, self.z_coeff, self.bias_rate, self.layer_id = aux_coeff, z_coeff, bias_rate, layer_id
        self.router = Router(d_model, n_experts, router, groups=groups, group_top_k=group_top_k, gate_scale=gate_scale)
        self.experts = Experts(n_experts, d_model, d_expert or d_ff, flavor)
        width = n_shared * (d_expert or d_ff)
        gelu = self.experts.gelu
        self.shared = None if not n_shared else (
            GeluMLP(d_model, width, approximate=gelu) if gelu is not None else SwiGLU(d_model, width))
        self.aux_loss: torch.Tensor | None = None
        self.last: tuple[Routing, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.stats = MoEStats(n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.router(h)
        experts, gates, probs = self.router.choose(logits, self.top_k)
        routing = self.slots(experts, gates)
        y = self.experts(h.index_select(0, routing.token), routing.counts)  # backward: an index_add, not index_put
        out = combine(y, routing, h.shape[0]).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(h)
        aux, z = self.router_losses(probs, logits, routing.routed)
        self.aux_loss = self.aux_coeff * aux + self.z_coeff * z
        self.last = (routing, probs, aux, z)
        return out.view(shape)

    def slots(self, experts: torch.Tensor, gates: torch.Tensor) -> Routing:
        """Where the tokens' choices ``experts [N, k]`` go, with their ``gates`` (:func:`assign`). (A dispatch
        that lays the slots out otherwise, :mod:`shardwise.parallel.expert.padded`, replaces it on the instance.)"""
        return assign(experts, gates, self.n_experts, self.capacity_factor)

    def router_losses(self, probs: torch.Tensor, logits: torch.Tensor, routed: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unweighted load-balancing and z losses over this forward's tokens. (Where one sequence's tokens
        are spread over ranks, :mod:`shardwise.parallel.expert.sequence` replaces it on the instance.)"""
        return load_balancing_loss(probs, routed), router_z_loss(logits)

    def record(self) -> None:
        """Add the last forward's routing to :attr:`stats` (the model calls it once per training forward)."""
        if self.last is not None:
            self.stats.add(*self.last)

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
                f"aux_coeff={self.aux_coeff}, z_coeff={self.z_coeff}")


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the weighted auxiliary losses of the last forward of every MoE block (``None``: none)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


TAIL = 6
"""The length of :attr:`RouterTotals.tail`."""


@dataclass
class RouterTotals:
    """One step's router sums over some MoE blocks (this rank's, or summed over ranks and joined over stages)."""

    layers: list[int]
    """The blocks' ``layer_id``, in order."""
    counts: torch.Tensor
    """``[L, 3, E]`` fp64: per block, the kept slots, the routed slots and the summed probability of each expert."""
    tail: torch.Tensor
    """``[TAIL]`` fp64: tokens, routed slots, dropped slots, summed unweighted aux and z losses, forwards."""

    def flat(self) -> torch.Tensor:
        """Every sum in one vector (summable over ranks: :meth:`with_flat` puts the sum back)."""
        return torch.cat([self.counts.reshape(-1), self.tail])

    def with_flat(self, flat: torch.Tensor) -> RouterTotals:
        n = self.counts.numel()
        return RouterTotals(self.layers, flat[:n].view(self.counts.shape), flat[n:])

    @staticmethod
    def join(parts: list[RouterTotals]) -> RouterTotals:
        """Several pipeline stages' blocks as one model's: blocks concatenated, the tails added."""
        return RouterTotals([i for p in parts for i in p.layers], torch.cat([p.counts for p in parts]),
                            torch.stack([p.tail for p in parts]).sum(0))


def pop_moe_totals(model: nn.Module) -> RouterTotals | None:
    """This step's router sums over every MoE block of ``model`` (reset afterwards); ``None`` without MoE blocks.
    They stay on the router's device (nothing waits for it); the router step queues their copy to the host."""
    layers = moe_layers(model)
    if not layers:
        return None
    device = next((m.stats.sums.device for m in layers if m.stats.sums is not None), torch.device("cpu"))
    per_layer = [m.stats.sums if m.stats.sums is not None else
                 torch.zeros(3, m.n_experts, dtype=torch.float64, device=device) for m in layers]
    losses = [torch.stack([t.double() for t in m.stats.aux + m.stats.z]).view(2, -1).sum(1) if m.stats.aux else
              torch.zeros(2, dtype=torch.float64, device=device) for m in layers]
    counts, losses = torch.stack(per_layer), torch.stack(losses).sum(0)
    routed, kept = counts[:, 1].sum(), counts[:, 0].sum()  # dropped: routed but not kept
    host = torch.full((2,), 0.0, dtype=torch.float64, device=device)  # the host's counts, as kernel arguments
    host[0], host[1] = float(sum(m.stats.tokens for m in layers)), float(sum(m.stats.calls for m in layers))
    tail = torch.stack([host[0], routed, routed - kept, losses[0], losses[1], host[1]])
    for m in layers:
        m.stats.reset()
    return RouterTotals([m.layer_id for m in layers], counts, tail)


def moe_metrics(totals: RouterTotals) -> dict[str, float | list[int]]:
    """Metrics from :func:`pop_moe_totals` (summed over data-parallel ranks): ``moe_aux_loss`` / ``moe_z_loss``
    (unweighted, mean over blocks and forwards), ``moe_tokens_per_expert_{min,max,mean}`` (kept slots per expert
    and block in the step), ``moe_dropped_frac`` (dropped / routed slots) and, per MoE block ``i``,
    ``moe_load_layer{i}``: the slots the router sent to each expert in the step (a list, the expert load)."""
    _tokens, slots, dropped, aux, z, calls = totals.tail.tolist()
    if not calls:
        return {}
    kept = totals.counts[:, 0]
    out: dict[str, float | list[int]] = {
        "moe_aux_loss": aux / calls, "moe_z_loss": z / calls,
        "moe_tokens_per_expert_min": float(kept.min()), "moe_tokens_per_expert_max": float(kept.max()),
        "moe_tokens_per_expert_mean": float(kept.mean()), "moe_dropped_frac": dropped / max(slots, 1.0),
    }
    for layer, routed in zip(totals.layers, totals.counts[:, 1], strict=True):
        out[f"moe_load_layer{layer}"] = [int(v) for v in routed.tolist()]
    return out
