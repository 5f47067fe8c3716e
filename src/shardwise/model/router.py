"""The routers of a mixture-of-experts block: which ``k`` of ``E`` experts each token goes to, with which gates.

Plain single-device code. Every router scores a token ``h`` against the experts with one bias-free linear
map, ``z = h W_r`` (fp32), and differs in how it turns the logits ``z`` into a choice and gates
(:data:`ROUTERS`):

* ``softmax`` -- Switch / GShard (Fedus et al. 2022, "Switch Transformers", eq. 1-2; Lepikhin et al. 2021,
  "GShard", Algorithm 1): ``p = softmax(z)``; the top-k experts of ``p``, gated by their *un-normalised*
  probabilities;
* ``softmax_renorm`` -- Mixtral (Jiang et al. 2024, "Mixtral of Experts", §2.1: the softmax over the top-k
  logits, which is the top-k of ``p`` renormalised) and Qwen3-MoE (``norm_topk_prob``): the same choice,
  the k gates divided by their sum;
* ``sigmoid_bias`` -- DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §2.1.2, eq. 13-16):
  scores ``s = sigmoid(z)``; the top-k of ``s + b`` are chosen, with ``b`` a per-expert bias that is not
  trained by the gradient; the gates are the chosen *scores* (without the bias) normalised to sum 1.
  After every optimizer step the bias moves by ``rate * sign(mean load - load_i)`` (Wang et al. 2024,
  "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", Algorithm 1), where ``load_i`` is
  the number of tokens the router sent to expert ``i`` in the step's whole global batch: every rank
  applies the same update to the same bias (:func:`update_expert_bias`). The bias is model state
  (a persistent buffer: checkpointed, loaded, exported), so no auxiliary loss is needed.

Group-limited routing (DeepSeek-V3 §2.1.2 and its released configuration; DeepSeek-V2 §2.1.2, "device-limited
routing"): the experts are cut into ``groups`` equal groups, each group scored by the sum of its two highest
``s + b``; a token chooses its k experts among the ``group_top_k`` best groups only. ``gate_scale`` multiplies
the gates (DeepSeek-V3's ``routed_scaling_factor``).

For the auxiliary losses and the balance statistics, ``P_i`` (the router's mean probability of expert
``i``) is the softmax's for the first two and the normalised sigmoid scores ``s / sum_j s_j`` for
``sigmoid_bias`` (DeepSeek-V3 §2.1.2, eq. 18, the sequence-wise balance loss's ``s'``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = ("softmax", "softmax_renorm", "sigmoid_bias")
"""``model.moe_router`` (mirrored, without torch, in :data:`shardwise.config.MOE_ROUTERS`)."""


class Router(nn.Module):
    """``E`` expert scores per token: ``weight [E, d_model]``; with ``sigmoid_bias`` the buffer
    ``expert_bias [E]`` (fp32, zeros at the start) that only :func:`update_expert_bias` changes."""

    def __init__(self, d_model: int, n_experts: int, kind: str = "softmax", *, groups: int = 1, group_top_k: int = 1,
                 gate_scale: float = 1.0):
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"model.moe_router={kind!r} is not valid; use one of {', '.join(map(repr, ROUTERS))}")
        if n_experts % groups or not 1 <= group_top_k <= groups:
            raise ValueError(f"{groups} expert groups (top {group_top_k}) do not fit {n_experts} experts")
        self.kind, self.groups, self.group_top_k, self.gate_scale = kind, groups, group_top_k, gate_scale
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.register_buffer("expert_bias", torch.zeros(n_experts) if kind == "sigmoid_bias" else None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero the balancing bias (the weight is initialised by the model, from its name)."""
        if self.expert_bias is not None and not self.expert_bias.is_meta:
            self.expert_bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The fp32 router logits ``z [N, E]`` of tokens ``h [N, d_model]``."""
        return F.linear(h, self.weight).float()

    def choose(self, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(experts [N, k], gates [N, k], probs [N, E])``: each token's k experts in order of preference, their
        gates, and the probabilities the balance statistics and the auxiliary loss use."""
        if self.kind == "sigmoid_bias":
            scores = logits.sigmoid()
            experts = self.limit_to_groups(scores + self.expert_bias.to(scores.device)).topk(top_k, dim=-1).indices
            gates = scores.gather(-1, experts)
            gates = gates / gates.sum(-1, keepdim=True)
            return experts, gates * self.gate_scale, scores / scores.sum(-1, keepdim=True)
        probs = logits.softmax(dim=-1)
        gates, experts = self.limit_to_groups(probs).topk(top_k, dim=-1)
        if self.kind == "softmax_renorm":
            gates = gates / gates.sum(-1, keepdim=True)
        return experts, gates * self.gate_scale, probs

    def limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice [N, E]`` with the experts outside each token's ``group_top_k`` best groups at -inf (a group
        scores the sum of its two best entries); unchanged with one group."""
        if self.groups == 1:
            return choice
        n, e = choice.shape
        grouped = choice.view(n, self.groups, e // self.groups)
        best = grouped.topk(min(2, e // self.groups), dim=-1).values.sum(-1)  # [N, groups]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.group_top_k, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)

    def extra_repr(self) -> str:
        groups = f", top {self.group_top_k} of {self.groups} groups" if self.groups > 1 else ""
        scale = f", gates x {self.gate_scale}" if self.gate_scale != 1 else ""
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]} experts, {self.kind}{groups}{scale}"


@torch.no_grad()
def update_expert_bias(router: Router, load: torch.Tensor, rate: float, skipped: torch.Tensor | None = None) -> None:
    """Wang et al. 2024, Algorithm 1: ``b_i += rate * sign(mean(load) - load_i)`` for the tokens ``load [E]``
    routed to each expert in one step (the global batch's, so every rank computes the same update).
    A router without a bias (softmax, softmax_renorm) is left alone. ``skipped`` (a 0-dim 0/1 tensor): where it
    is 1 (a step the trainer skipped) the bias stays as it was."""
    if router.expert_bias is None:
        return
    load = load.to(torch.float64)
    step = rate * torch.sign(load.mean() - load)
    if skipped is not None:
        step = step * (1 - skipped.to(step.device, torch.float64))
    router.expert_bias.add_(step.to(router.expert_bias.dtype).to(router.expert_bias.device))
