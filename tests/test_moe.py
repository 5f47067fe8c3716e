"""The single-device mixture-of-experts block against published and derivable numbers."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.model.moe import MoE, capacity, combine, load_balancing_loss, route, router_z_loss


def test_uniform_routing_gives_the_coefficient_exactly():
    """Switch eq. 4: with f_i = P_i = 1/E the loss is E * E * (1/E^2) = 1, i.e. aux = coefficient."""
    e, n, k = 4, 8, 2
    probs = torch.full((n, e), 1 / e)
    routed = torch.full((e,), n * k // e)
    assert load_balancing_loss(probs, routed).item() == 1.0


def test_all_tokens_to_one_expert():
    """E=4, k=1, every token to expert 0 with probabilities [.7, .1, .1, .1]: 4 * 1 * .7 = 2.8."""
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(16, 1)
    routing = route(probs, 1, 0.0)
    assert routing.routed.tolist() == [16, 0, 0, 0]
    assert load_balancing_loss(probs, routing.routed).item() == pytest.approx(2.8, abs=1e-6)


def test_z_loss_of_known_logits():
    """ST-MoE eq. 5: logits [0, 0] give (log 2)^2; [ln 3, 0, 0] give (log 5)^2; the loss is their mean."""
    logits = torch.tensor([[0.0, 0.0, -math.inf], [math.log(3), 0.0, 0.0]])
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(5) ** 2) / 2, rel=1e-6)


def test_capacity():
    """T=16 tokens, k=2, E=8: capacity 4 at factor 1, 5 at 1.25; factor 0 is unbounded."""
    assert capacity(16, 2, 8, 1.0) == 4
    assert capacity(16, 2, 8, 1.25) == 5
    assert capacity(16, 2, 8, 0.0) is None


def test_drops_follow_choice_major_priority():
    """4 tokens, E=2, k=1, capacity factor 1 -> 2 slots per expert: every token prefers expert 0, so tokens
    0 and 1 keep it and 2, 3 are dropped; with k=2 first choices come before any second choice."""
    probs = torch.tensor([[0.9, 0.1]] * 4)
    r = route(probs, 1, 1.0)
    assert r.token.tolist() == [0, 1] and r.counts.tolist() == [2, 0] and r.dropped == 2
    r2 = route(probs, 2, 1.0)  # capacity 4: all four first choices (expert 0) and all second choices fit
    assert r2.dropped == 0 and r2.counts.tolist() == [4, 4]
    r3 = route(probs, 2, 0.5)  # capacity 2 per expert
    assert r3.counts.tolist() == [2, 2] and r3.token.tolist() == [0, 1, 0, 1] and r3.dropped == 4


def test_dispatch_then_combine_with_weights_one_over_k_restores_the_input_and_its_gradient():
    n, e, k, d = 10, 4, 2, 3
    x = torch.randn(n, d, requires_grad=True)
    routing = route(torch.randn(n, e).softmax(-1), k, 0.0)
    routing.gate = torch.full_like(routing.gate, 1 / k)
    y = combine(x[routing.token], routing, n)  # identity experts
    torch.testing.assert_close(y, x)
    g = torch.randn(n, d)
    y.backward(g)
    torch.testing.assert_close(x.grad, g)


def test_shared_expert_and_aux_losses_reach_the_router():
    torch.manual_seed(0)
    moe = MoE(8, 16, "llama", 4, 2, n_shared=1, aux_coeff=0.01, z_coeff=0.001)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    y = moe(torch.randn(2, 5, 8))
    assert y.shape == (2, 5, 8)
    moe.aux_loss.backward()  # the auxiliary losses alone give the router a gradient
    assert moe.router.weight.grad.abs().sum() > 0


def _spec(**overrides):
    from shardwise.config import Config
    from shardwise.plan.spec import model_spec

    return model_spec(Config.load(overrides={"parallel.nproc": "1", **overrides}))


def test_mixtral_shaped_preset_has_the_published_parameter_counts():
    """Jiang et al. 2024 ("Mixtral of Experts", §2): 46.7B parameters in total, 12.9B active per token."""
    from shardwise.plan.params import count_params

    c = count_params(_spec(**{"model.preset": "mixtral-8x7b"}))
    assert round(c.total / 1e9, 1) == 46.7
    assert round(c.active / 1e9, 1) == 12.9


@pytest.mark.parametrize("over", [
    {"model.preset": "tiny-moe", "model.moe_every": "2", "model.moe_shared": "1"},
    {"model.preset": "tiny-llama", "model.n_experts": "4", "model.moe_every": "2", "model.moe_d_ff": "48",
     "model.qk_norm": "true", "model.moe_router": "sigmoid_bias"},  # Qwen3-MoE's shape: expert width, QK-norm
], ids=["gpt2-shared", "llama-qwen3-shape"])
def test_planner_counts_equal_the_built_model(over):
    """The planner's exact count (moe_every, shared experts, gpt2 biases, the experts' own width, QK-norm gains)
    equals the model's parameters."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer
    from shardwise.plan.params import block_params, count_params

    over = {**over, "parallel.nproc": "1"}
    cfg = resolve(Config.load(overrides=over), tokenizer_vocab=257)
    model = Transformer(cfg.model)
    assert count_params(_spec(**over)).total == model.num_parameters()
    moe_block = model.blocks[cfg.model.moe_every - 1]
    assert block_params(_spec(**over)) == sum(p.numel() for p in moe_block.parameters())


def test_plot_adds_an_expert_load_row_and_heat_map(tmp_path):
    import json
    import struct

    from shardwise.plot import plot_runs

    for name, moe in (("dense", False), ("moe", True)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in range(1, 6):
                rec = {"step": step, "loss": 5.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0}
                if moe:
                    rec |= {"moe_tokens_per_expert_mean": 32.0, "moe_tokens_per_expert_min": 20.0 + step,
                            "moe_tokens_per_expert_max": 50.0 - step, "moe_aux_loss": 1.1, "moe_dropped_frac": 0.1,
                            "moe_load_layer0": [20 + step, 30, 40, 38 - step], "moe_load_layer1": [32] * 4}
                f.write(json.dumps(rec) + "\n")
    sizes = {}
    for runs in (["dense"], ["dense", "moe"]):
        out = plot_runs([tmp_path / r for r in runs], tmp_path / f"{len(runs)}.png")
        sizes[len(runs)] = struct.unpack(">II", out.read_bytes()[16:24])  # the PNG's width, height
    assert sizes[1][1] == 800 and sizes[2][1] == 1600, sizes  # MoE: the expert-load row and the load heat map
