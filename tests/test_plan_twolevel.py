"""The planner's two-level network: flows sharing a node's link (max-rate model) and ZeRO's pairwise
exchanges on gloo."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.plan.comm import _flat, collective_time
from shardwise.plan.hardware import BUILTIN_GPUS, GPU, Cluster, load_catalogue

MB = 1 << 20


def cpu_link(node_gbit: float = 1.0) -> GPU:
    """A node whose one link (node_gbit) any one rank can fill: the simulated cluster's veth pair."""
    return GPU("cpu", {"fp32": 1e10}, 16e9, intra_bw=1e9, inter_bw=node_gbit / 8 * 1e9, intra_latency=1e-4,
               inter_latency=5e-5, node_bw=node_gbit / 8 * 1e9)


def test_one_nic_per_gpu_is_unchanged():
    h100 = Cluster(BUILTIN_GPUS["H100"], gpus_per_node=8, nodes=2)
    g = h100.gpu
    assert h100.node_bw == 8 * g.inter_bw
    flat = _flat("all-reduce", 16, 64 * MB, g.inter_latency, g.inter_bw)
    hier = (_flat("reduce-scatter", 8, 64 * MB, g.intra_latency, g.intra_bw)
            + _flat("all-reduce", 2, 8 * MB, g.inter_latency, g.inter_bw)
            + _flat("all-gather", 8, 64 * MB, g.intra_latency, g.intra_bw))
    assert collective_time("all-reduce", 16, 64 * MB, 1, h100) == pytest.approx(min(flat, hier))


def test_a_shared_node_link_slows_the_flows_that_cross_at_once():
    """2 nodes x 2 ranks on one 1 Gbit/s link each: the flat ring sends one flow per node across (the whole
    link), the hierarchical form's inter-node phase two (half each)."""
    c = Cluster(cpu_link(), gpus_per_node=2, nodes=2)
    g = c.gpu
    n = 16 * MB
    leaders = collective_time("all-gather", 2, n, 2, c)  # one rank per node: one flow, the whole link
    assert leaders == pytest.approx(_flat("all-gather", 2, n, g.inter_latency, g.inter_bw))
    shared = collective_time("all-gather", 4, n, 1, c)
    per_gpu = Cluster(dataclasses.replace(g, node_bw=0.0), 2, 2)  # one NIC per rank: the two flows do not share
    assert collective_time("all-gather", 4, n, 1, per_gpu) < shared
    assert shared <= _flat("all-gather", 4, n, g.inter_latency, g.inter_bw)  # never worse than the flat ring


def test_zero_on_gloo_is_a_pairwise_exchange():
    """Each rank posts its n/p block to every other rank at once: 2 blocks cross per rank, 4 per node link."""
    c = Cluster(cpu_link(), gpus_per_node=2, nodes=2, backend="gloo")
    g, n, p, local = c.gpu, 4 * MB, 4, 2
    across = (p - local) * (g.inter_latency + n / p / (c.node_bw / local))
    assert collective_time("all-gather", p, n, 1, c, "pairwise") == pytest.approx(across)
    assert collective_time("all-gather", p, n, 1, c, "pairwise") > collective_time("all-gather", p, n, 1, c)
    one_node = Cluster(cpu_link(), gpus_per_node=4, nodes=1, backend="gloo")
    assert collective_time("reduce-scatter", 4, n, 1, one_node, "pairwise") == pytest.approx(
        3 * (g.intra_latency + n / 4 / g.intra_bw))


def test_hardware_file_gives_the_node_link(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text("[gpu.box]\nfp32_tflops = 1\nmemory_gb = 16\nnvlink_gbps = 10\nnetwork_gbit = 1\n"
                 "node_network_gbit = 1\n")
    gpu = load_catalogue(f)["box"]
    assert gpu.node_bw == pytest.approx(1 / 8 * 1e9) == pytest.approx(gpu.inter_bw)
    assert Cluster(gpu, gpus_per_node=2).node_bw == gpu.node_bw


def test_each_collective_call_costs_the_measured_call_latency():
    """ZeRO-3 on 4 ranks: one gather per unit and pass, one reduce-scatter per unit, the flags, the loss and
    the norm: each call costs ``call_latency`` on top (0 by default: accelerators unchanged)."""
    from shardwise.plan.memory import StateDtypes
    from shardwise.plan.perf import step_time
    from shardwise.plan.spec import Layout, ModelSpec
    from shardwise.plan.zero_layout import ZeroUnits

    m = ModelSpec("gpt2", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=256, vocab_size=1000,
                  max_seq_len=64, tie_embeddings=True)
    lay = Layout(dp=4, zero=3, micro_batch=4)
    units = ZeroUnits(stage=3, world=4, numels=(70000, 50000, 50000), root_units=1, n_tensors=20)
    base = Cluster(cpu_link(), gpus_per_node=2, nodes=2, backend="gloo")
    states = StateDtypes()
    quiet = step_time(m, lay, 64, base, states, "fp32", units=units)
    loud = step_time(m, lay, 64, dataclasses.replace(base, call_latency=2e-3), states, "fp32", units=units)
    calls = 1 + 2 * 2 + 3 + 1 + 2  # root gather, 2 blocks x (fwd, bwd), 3 reduce-scatters, flags, loss, norm
    assert quiet.sync_s == 0 and loud.collectives_per_step == calls
    assert loud.step_time_s - quiet.step_time_s == pytest.approx(calls * 2e-3)
