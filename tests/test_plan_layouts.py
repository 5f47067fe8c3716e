"""Memory per rank, communication, time and the layout search."""

from __future__ import annotations

import pytest

from shardwise.config import Config
from shardwise.plan.comm import collective_time, comm_items
from shardwise.plan.hardware import BUILTIN_GPUS, Cluster, find_gpu, load_catalogue
from shardwise.plan.memory import (
    STATE_CONVENTIONS,
    activation_bytes_per_layer,
    memory_breakdown,
    params_per_rank,
    parse_state_dtypes,
)
from shardwise.plan.params import count_params
from shardwise.plan.perf import step_time
from shardwise.plan.search import check, search
from shardwise.plan.spec import Layout, model_spec

FP32 = STATE_CONVENTIONS["shardwise"]
H100 = BUILTIN_GPUS["H100"]


def spec(preset="gpt2-124m", **kw):
    return model_spec(Config.load(overrides={"model.preset": preset, **kw}))


def test_data_parallel_model_states_are_16_bytes_per_parameter():
    m = spec()
    mem = memory_breakdown(m, Layout(dp=2), 1024, FP32).by_metric()
    n = count_params(m).total
    assert mem["mem_params_bytes"] == 4 * n and mem["mem_grads_bytes"] == 4 * n
    assert mem["mem_optimizer_bytes"] == 8 * n and mem["mem_master_bytes"] == 0


def test_zero_and_offload():
    m = spec()
    n = count_params(m).total
    z3 = memory_breakdown(m, Layout(dp=4, zero=3), 1024, FP32)
    assert z3.by_metric()["mem_params_bytes"] == pytest.approx(n * 4 / 4)
    off = memory_breakdown(m, Layout(dp=4, zero=2, offload="cpu"), 1024, FP32)
    assert off.by_metric("host")["mem_optimizer_bytes"] == pytest.approx(8 * n / 4)
    assert off.by_metric()["mem_optimizer_bytes"] == 0
    assert off.total() < memory_breakdown(m, Layout(dp=4, zero=2), 1024, FP32).total()


def test_tensor_and_pipeline_split_parameters():
    m = spec("gpt3-175b")
    dense1, _ = params_per_rank(m, Layout())
    assert dense1 == count_params(m).total
    dense8, _ = params_per_rank(m, Layout(tp=8, pp=8))
    # 12 of 96 layers split 8 ways, plus the first stage's vocabulary-parallel embedding and positions
    c = count_params(m)
    layers = (c.attention + c.mlp) / 96 * 12 / 8
    assert dense8 == pytest.approx(layers + c.embedding / 8 + c.position, rel=1e-3)


def test_pipeline_first_stage_and_interleaving_factor():
    m = spec("gpt3-175b")
    s, p, mbs = 2048, 8, 16
    per_layer = activation_bytes_per_layer(m, s, 1, 8, True, "selective", "flash", mode="16bit")
    lay = Layout(dp=1, tp=8, pp=p, micro_batch=1, grad_accum=mbs, recompute="selective", sequence_parallel=True)
    act = memory_breakdown(m, lay, s, FP32).by_metric()["mem_activations_bytes"]
    assert act == pytest.approx(per_layer * m.n_layers)  # first stage: p micro-batches of L/p layers = L layers
    v = 3
    lay_v = Layout(dp=1, tp=8, pp=p, micro_batch=1, grad_accum=mbs, recompute="selective", sequence_parallel=True,
                   pp_virtual=v)
    act_v = memory_breakdown(m, lay_v, s, FP32).by_metric()["mem_activations_bytes"]
    assert act_v == pytest.approx(act * (1 + (p - 1) / (p * v)))


def test_alpha_beta_ring_and_two_levels():
    n = 1e9
    intra = collective_time("all-reduce", 8, n, 1, Cluster(H100, 8, 1))
    assert intra == pytest.approx(2 * 7 * H100.intra_latency + 2 * 7 / 8 * n / H100.intra_bw)
    two = Cluster(H100, 8, 4)
    flat = 2 * 31 * H100.inter_latency + 2 * 31 / 32 * n / H100.inter_bw
    hier = collective_time("all-reduce", 32, n, 1, two)
    assert hier < flat
    assert collective_time("all-reduce", 4, n, 8, two) == pytest.approx(
        2 * 3 * H100.inter_latency + 2 * 3 / 4 * n / H100.inter_bw)


def test_comm_volumes_per_technique():
    m = spec()
    n = count_params(m).total
    cl = Cluster(H100, 8, 1)
    dp = comm_items(m, Layout(dp=8), 1024, FP32, cl)
    assert [(c.technique, c.collective) for c in dp] == [("data parallel", "all-reduce")]
    assert dp[0].payload == 4 * n  # the trainer's comm_bytes: the gradients handed to all-reduce
    z3 = comm_items(m, Layout(dp=8, zero=3), 1024, FP32, cl)
    assert sum(c.sent_bytes for c in z3) == pytest.approx(1.5 * dp[0].sent_bytes)  # ZeRO §7.2.2
    tp = comm_items(m, Layout(dp=1, tp=4, micro_batch=2), 1024, FP32, cl)
    assert tp[0].collective == "all-reduce" and tp[0].payload == 2 * 1024 * 768 * 2 and tp[0].calls == 4 * 12
    sp = comm_items(m, Layout(dp=1, tp=4, micro_batch=2, sequence_parallel=True), 1024, FP32, cl)
    assert sum(c.sent_bytes for c in sp) == pytest.approx(tp[0].sent_bytes)
    moe = spec("tiny-llama")
    from dataclasses import replace
    moe = replace(moe, n_experts=4, moe_top_k=2)
    ep = comm_items(moe, Layout(dp=4, ep=4), 64, FP32, cl)
    assert any(c.technique == "expert parallel" and c.collective == "all-to-all" for c in ep)


def test_step_time_bubble_and_mfu():
    m = spec("gpt3-175b")
    cl = Cluster(find_gpu("A100"), 8, 128, efficiency=0.5)
    lay = Layout(dp=16, tp=8, pp=8, micro_batch=1, grad_accum=96, zero=1, recompute="full", sequence_parallel=True)
    t = step_time(m, lay, 2048, cl, STATE_CONVENTIONS["mixed"])
    assert t.bubble_fraction == pytest.approx(7 / (96 + 7))  # (p-1)/m of the ideal time
    assert t.step_time_s == pytest.approx(t.compute_s + t.bubble_s + t.comm_exposed_s)
    assert 0 < t.mfu < 0.5
    assert t.tokens_per_s == pytest.approx(1536 * 2048 / t.step_time_s)


def test_search_ranks_and_explains_drops():
    m = spec()
    res = search(m, 1024, Cluster(H100, 8, 1), {}, 64, FP32, top=5)
    assert len(res.ranked) == 5
    tps = [c.time.tokens_per_s for c in res.ranked]
    assert tps == sorted(tps, reverse=True)
    assert all(c.layout.world == 8 for c in res.ranked)
    assert res.dropped["tp does not divide the (key/value) heads"] > 0  # 12 heads, tp = 8
    fixed = search(m, 1024, Cluster(H100, 8, 1), {"tp": 2, "zero": 1, "micro_batch": 4}, 64, FP32, top=0)
    assert fixed.ranked and all(c.layout.tp == 2 and c.layout.zero == 1 and c.layout.micro_batch == 4
                                for c in fixed.ranked)
    big = search(spec("gpt3-175b"), 2048, Cluster(H100, 8, 1), {"tp": 1, "pp": 1}, 8, FP32, top=5)
    assert not big.ranked and any("does not fit" in r for r in big.dropped)
    assert check(spec("gpt2-124m"), Layout(dp=2, tp=4, pp=1), 1024, Cluster(H100, 8, 1)) is None
    assert "heads" in check(spec("gpt2-1.5b"), Layout(dp=1, tp=8), 1024, Cluster(H100, 8, 1))
    assert check(m, Layout(dp=4, pp=2, zero=3), 1024, Cluster(H100, 8, 1)) is None  # ZeRO-3 in a pipeline runs


def test_hardware_catalogue_and_toml(tmp_path):
    for name in ("V100", "A100-40GB", "A100-80GB", "H100", "H200", "B200"):
        assert BUILTIN_GPUS[name].peak("fp32") > 0
    assert find_gpu("a100").name == "A100-80GB"
    assert BUILTIN_GPUS["V100"].peak("bf16") == BUILTIN_GPUS["V100"].peak("fp32")  # no bf16 tensor cores
    cat = load_catalogue("configs/hardware.toml")
    assert cat["H100-PCIe"].peak("bf16") == 756e12 and cat["H100"].inter_bw == 100e9
    assert cat["H100"].memory_bytes == H100.memory_bytes
    bad = tmp_path / "hw.toml"
    bad.write_text("[gpu.X]\nbogus = 1\n")
    with pytest.raises(ValueError, match="unknown fields"):
        load_catalogue(bad)
    with pytest.raises(ValueError, match="unknown GPU"):
        find_gpu("Z80")


def test_state_dtypes_parse():
    assert parse_state_dtypes("weights=fp32,grads=bf16,momentum=bf16,variance=fp32").per_param == 12
    with pytest.raises(ValueError):
        parse_state_dtypes("weights=int4")
