"""The three routers against hand-computed examples, the balancing bias as model state, the per-block load in
the metrics, and the sigmoid_bias router trained under every layout MoE composes with (the same model and the
same bias as one process)."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.model.router import Router, update_expert_bias
from tests.test_train import assert_same_training, run

LN3 = math.log(3.0)


def _router(kind: str, bias=None) -> Router:
    r = Router(2, 3, kind)
    if bias is not None:
        r.expert_bias.copy_(torch.tensor(bias))
    return r


def test_softmax_router_keeps_the_top_k_probabilities():
    """Logits [ln 3, 0, ln 1/3] give softmax [9, 3, 1] / 13; top-2 = experts 0, 1 with gates 9/13, 3/13."""
    experts, gates, probs = _router("softmax").choose(torch.tensor([[LN3, 0.0, -LN3]]), 2)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(gates, torch.tensor([[9 / 13, 3 / 13]]))
    torch.testing.assert_close(probs, torch.tensor([[9 / 13, 3 / 13, 1 / 13]]))


def test_softmax_renorm_router_renormalises_the_chosen_gates():
    """The same choice; the gates 9/13, 3/13 divided by their sum 12/13: 3/4 and 1/4 (Mixtral, Qwen3-MoE)."""
    experts, gates, _ = _router("softmax_renorm").choose(torch.tensor([[LN3, 0.0, -LN3]]), 2)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(gates, torch.tensor([[0.75, 0.25]]))


def test_sigmoid_bias_router_chooses_by_score_plus_bias_and_gates_by_the_score():
    """Scores sigmoid([0, ln 3, -ln 3]) = [1/2, 3/4, 1/4]; bias [0, -1, 1/2] makes score + bias [1/2, -1/4, 3/4]:
    top-1 is expert 2 (gate 1), top-2 experts 2 and 0 with gates 1/4 and 1/2 normalised: 1/3, 2/3. The balance
    probabilities are the scores normalised over all experts: [1/3, 1/2, 1/6]."""
    r = _router("sigmoid_bias", [0.0, -1.0, 0.5])
    logits = torch.tensor([[0.0, LN3, -LN3]])
    experts, gates, _ = r.choose(logits, 1)
    assert experts.tolist() == [[2]] and gates.tolist() == [[1.0]]
    experts, gates, probs = r.choose(logits, 2)
    assert experts.tolist() == [[2, 0]]
    torch.testing.assert_close(gates, torch.tensor([[1 / 3, 2 / 3]]))
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 1 / 2, 1 / 6]]))
    # without the bias the same token goes to expert 1 (the highest score)
    assert _router("sigmoid_bias").choose(logits, 1)[0].tolist() == [[1]]


def test_bias_moves_towards_the_mean_load():
    """Wang et al. 2024, Algorithm 1: load [10, 2, 0, 4] has mean 4; rate 0.1 gives [-0.1, +0.1, +0.1, 0]."""
    r = Router(2, 4, "sigmoid_bias")
    update_expert_bias(r, torch.tensor([10.0, 2.0, 0.0, 4.0]), 0.1)
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.0]))
    plain = Router(2, 4, "softmax")
    update_expert_bias(plain, torch.tensor([10.0, 2.0, 0.0, 4.0]), 0.1)  # nothing to move
    assert plain.expert_bias is None and "router.expert_bias" not in dict(plain.named_buffers())


def test_bias_is_model_state_and_balances_without_an_auxiliary_loss():
    """The bias is a persistent buffer (in the state dict, zero at the start, kept by load_state_dict); a router
    whose weights send every token to expert 0 is balanced by the bias alone within a few hundred steps."""
    from shardwise.model.moe import MoE

    moe = MoE(4, 8, "llama", 4, 1, router="sigmoid_bias", bias_rate=0.01)
    assert "router.expert_bias" in moe.state_dict() and moe.router.expert_bias.tolist() == [0.0] * 4
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(4, 4, generator=g))
        moe.router.weight[:, 0] = torch.tensor([6.0, 0.0, 0.0, 0.0])  # feature 0 (always 1) favours expert 0
    x = torch.randn(1, 64, 4, generator=g)
    x[..., 0] = 1.0
    loads = []
    for _ in range(300):
        moe(x)
        loads.append(moe.last[0].routed.double())
        update_expert_bias(moe.router, loads[-1], moe.bias_rate)
    assert loads[0][0] >= 60  # nearly every token to expert 0 at first
    late = torch.stack(loads[-50:]).mean(0)
    assert late.max() <= 64 / 4 * 1.5, late.tolist()
    copy = MoE(4, 8, "llama", 4, 1, router="sigmoid_bias")
    copy.load_state_dict(moe.state_dict())
    assert torch.equal(copy.router.expert_bias, moe.router.expert_bias)


def test_collapse_watch_warns_once_after_many_steps():
    from shardwise.parallel.expert.router_step import COLLAPSE_STEPS, CollapseWatch

    watch = CollapseWatch(4, 1)  # fair share 1/4; overloaded above 1/2
    notes = [watch.check(s, {"moe_load_layer1": [90, 5, 3, 2], "moe_load_layer3": [25, 25, 25, 25]})
             for s in range(1, 2 * COLLAPSE_STEPS)]
    fired = [i + 1 for i, n in enumerate(notes) if n]
    assert fired == [COLLAPSE_STEPS]
    assert notes[COLLAPSE_STEPS - 1].startswith(f"warning: router collapse in block 1 at step {COLLAPSE_STEPS}: "
                                                "expert 0 took 90% of the tokens")
    assert CollapseWatch(4, 2).limit == 0.75  # 2k >= E: halfway between the fair 1/2 and all


def test_router_fields_are_checked():
    from shardwise.config import Config, ConfigError
    from shardwise.config_resolve import resolve

    def cfg(**over):
        return resolve(Config.load(overrides={"model.preset": "tiny-moe", "parallel.nproc": "1", **over}),
                       tokenizer_vocab=257)

    with pytest.raises(ConfigError, match=r"^model.moe_router='topk' is not valid; use one of 'softmax', "
                                          r"'softmax_renorm', 'sigmoid_bias'$"):
        cfg(**{"model.moe_router": "topk"})
    with pytest.raises(ConfigError, match=r"^model.moe_bias_rate=0.01 moves the sigmoid_bias router's balancing "
                                          r"bias, but model.moe_router='softmax' has none"):
        cfg(**{"model.moe_bias_rate": "0.01"})
    with pytest.raises(ConfigError, match=r"^model.qk_norm=true normalises llama's query and key heads; "
                                          r"model.flavor='gpt2' has none"):
        cfg(**{"model.qk_norm": "true"})
    assert cfg(**{"model.moe_router": "sigmoid_bias", "model.moe_bias_rate": "0.01"}).model.moe_bias_rate == 0.01


SIGMOID = {"model.preset": "tiny-moe", "train.steps": 3, "model.moe_router": "sigmoid_bias",
           "model.moe_bias_rate": 0.01, "model.moe_aux_coeff": 0.0}


@pytest.fixture(scope="module")
def sigmoid_reference(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("ref-sigmoid")
    return {dp: run(tmp, cache_dir, f"ref{dp}", 1, **SIGMOID, **{"train.micro_batch": 8 // dp}) for dp in (1, 2)}


@pytest.mark.parametrize("name,overrides", [
    ("ep2", {"parallel.ep": 2}),
    ("ep2-zero3", {"parallel.ep": 2, "parallel.zero": 3}),
    ("tp2", {"parallel.tp": 2}),
    ("pp2", {"parallel.pp": 2, "parallel.microbatches": 2}),
])
def test_sigmoid_bias_router_trains_the_same_model_on_every_layout(sigmoid_reference, tmp_path, cache_dir, name,
                                                                   overrides):
    """The bias moves by the global batch's load on every rank alike, so each layout ends with the single
    process's weights *and biases* (compared in the final state), losses and gradient norms; the biases moved."""
    result = run(tmp_path, cache_dir, name, 2, **SIGMOID, **overrides)
    assert_same_training(result, sigmoid_reference[1 if name == "tp2" else 2], atol=1e-5)
    biases = {k: v for k, v in result[1].items() if k.endswith("router.expert_bias")}
    assert len(biases) == 2 and all(v.abs().max() > 0 for v in biases.values()), biases
    import json

    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    loads = [r["moe_load_layer0"] for r in rows if "moe_load_layer0" in r]
    assert len(loads) == 3 and all(sum(load) == 8 * 32 * 2 for load in loads)  # every token's 2 slots, whole batch


def test_softmax_renorm_router_ep2_equals_one_process(tmp_path, cache_dir):
    renorm = {"model.preset": "tiny-moe", "train.steps": 3, "model.moe_router": "softmax_renorm"}
    ref = run(tmp_path, cache_dir, "renorm-ref", 1, **renorm, **{"train.micro_batch": 4})
    assert_same_training(run(tmp_path, cache_dir, "renorm-ep2", 2, **renorm, **{"parallel.ep": 2}), ref, atol=1e-5)
