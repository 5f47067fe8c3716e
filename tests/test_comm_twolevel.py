"""The two-level cost model: schedules timed on intra- and inter-node links, the node layout, calibration."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.dist.comm.cost import CostModel, cost, fit_regimes
from shardwise.dist.comm.twolevel import Levels, group_nodes, regular_node_size, schedule
from tests.harness import run_on_ranks

S = 64 << 20
OURS = ("ring", "rabenseifner", "recursive_doubling", "tree", "naive", "star", "hierarchical", "torus")


def two_nodes(L: int = 2, M: int = 2, alpha_a=5e-6, beta_a=1 / 25e9, alpha_e=20e-6, beta_flow=1 / 1.2e9,
              beta_node=1 / 1.2e9) -> CostModel:
    """M nodes of L ranks: fast links inside a node, a slow one between nodes."""
    nodes = tuple(r // L for r in range(L * M))
    return CostModel(alpha_e, beta_flow, 1e-11, L * M,
                     levels=Levels(nodes, alpha_a, beta_a, alpha_e, beta_flow, beta_node))


@pytest.mark.parametrize("L,M", [(2, 2), (4, 2), (2, 4), (8, 2)])
def test_a_slow_inter_link_picks_a_two_level_algorithm(L, M):
    m = two_nodes(L, M)
    assert m.node_size == L
    assert m.choose("all_reduce", S, OURS) in ("hierarchical", "torus")
    ring, hier = m.predict("all_reduce", "ring", S), m.predict("all_reduce", "hierarchical", S)
    assert hier < ring


def test_flat_ring_runs_at_the_inter_link_speed():
    """Every round of a ring over 2 nodes sends one flow across: 2(N-1) rounds of alpha_e + S/N beta_e."""
    m = two_nodes(L=4, M=2)
    lat, bw = m.levels.time("ring", S)
    n = 8
    assert lat == pytest.approx(2 * (n - 1) * 20e-6)
    assert bw == pytest.approx(2 * (n - 1) * S / n / 1.2e9)


def test_hierarchical_crosses_with_one_leader_per_node():
    """Hierarchical: its inter-node phase is a ring of the M leaders on S/M per step (2(M-1) steps); the
    torus sends its column rings from every rank at once, limited by the node's link (max-rate model)."""
    L, M = 4, 2
    crossing = [(rep, [(a, b) for a, b, _ in msgs if a // L != b // L]) for rep, msgs in
                schedule("hierarchical", L * M, S, L)]
    crossing = [(rep, msgs) for rep, msgs in crossing if msgs]
    assert sum(rep for rep, _ in crossing) == 2 * (M - 1)
    assert all(sorted(a for a, _ in msgs) == [0, L] for _, msgs in crossing)  # the leaders only
    # a node link as fast as L flows: the torus's L concurrent column rings beat the one leader ring
    fast_nic = two_nodes(L, M, beta_flow=1 / 1.2e9, beta_node=1 / 4.8e9)
    assert fast_nic.predict("all_reduce", "torus", S) < fast_nic.predict("all_reduce", "hierarchical", S)
    # one NIC shared by the node: L flows get 1/L each, the torus moves the same bytes over it as hierarchical
    shared = two_nodes(L, M)
    t_torus, t_hier = shared.levels.time("torus", S, L), shared.levels.time("hierarchical", S, L)
    assert t_torus[1] == pytest.approx(t_hier[1], rel=0.35)


def test_one_node_keeps_the_one_level_model():
    one = CostModel(1e-5, 1e-9, 1e-10, 4, shared_host=True)
    assert one.levels is None and one.node_size is None
    for alg in ("ring", "tree", "hierarchical"):
        c = cost("all_reduce", alg, S, 4, 2)
        assert one.predict("all_reduce", alg, S) == pytest.approx(c.steps * 1e-5 + c.total / 4 * 1e-9
                                                                  + c.reduced * 1e-10)
    assert one.choose("all_reduce", S, ("ring", "hierarchical", "tree")) == "ring"


def test_node_layouts():
    assert regular_node_size((0, 0, 1, 1)) == 2
    assert regular_node_size((0, 0, 0, 1)) is None and regular_node_size((0, 1, 0, 1)) is None
    regular = two_nodes()
    alternating = dataclasses.replace(regular.levels, nodes=(0, 1, 0, 1))
    irregular = CostModel(20e-6, 1 / 1.2e9, 1e-11, 4, levels=alternating)
    assert irregular.node_size is None
    # ranks alternating between nodes: every ring step sends two flows out of each node, twice the bytes
    assert irregular.predict("all_reduce", "ring", S) > 1.8 * regular.predict("all_reduce", "ring", S)


def test_margin_is_the_error_near_the_size():
    m = two_nodes()
    m.margin = 0.9  # as calibrate sets it across nodes
    m.errors = ((8, 1.0), (1 << 20, 0.02), (64 << 20, 0.25))
    assert m.margin_at(1 << 20) == m.margin == 0.9  # a 2 % error: the 10 % floor of a worthwhile gain decides
    assert m.margin_at(4 << 20) == pytest.approx(1 / 1.25)  # between 1 MiB and 64 MiB: the worse of the two
    assert m.margin_at(1 << 10) == pytest.approx(1 / 2)  # between 8 B (100 % off) and 1 MiB
    assert m.margin_at(1 << 30) == pytest.approx(1 / 1.25)  # beyond the calibration: its largest size


def test_fit_regimes_reads_latency_small_and_bandwidth_large():
    xs = [8.0, 65536.0, 262144.0, 1 << 20, 4 << 20]
    burst = [1.5e-4, 2.7e-4, 2.2e-3, 1.5e-4 + (1 << 20) * 8.3e-9, 1.5e-4 + (4 << 20) * 8.3e-9]
    a, b = fit_regimes(xs, burst)
    assert a == pytest.approx(1.5e-4) and b == pytest.approx(8.3e-9, rel=0.02)


def _layout_and_calibration():
    import torch.distributed as dist

    from shardwise.dist.comm.cost import calibrate

    sub = dist.new_group([1, 2, 3])  # every rank creates it; only members use it
    nodes_sub = group_nodes(sub, 2) if dist.get_rank() in (1, 2, 3) else None
    m = calibrate(reps=1, large=256 << 10, local_world_size=2)
    lv = m.levels
    return (group_nodes(None, 2), nodes_sub, lv.nodes, m.node_size,
            [lv.alpha_intra, lv.beta_intra, lv.alpha_inter, lv.beta_flow, lv.beta_node],
            m.choose("all_reduce", 1 << 20))


def test_calibration_measures_both_levels_and_agrees():
    """4 ranks on this host told they are 2 nodes of 2 (the launcher's LOCAL_WORLD_SIZE): every rank
    finds the same layout (also for a subgroup of global ranks 1-3), measures both levels and agrees."""
    results = run_on_ranks(4, _layout_and_calibration, timeout=300)
    nodes, sub, lv_nodes, node_size, consts, pick = results[0]
    assert nodes == lv_nodes == (0, 0, 1, 1) and node_size == 2
    assert results[1][1] == (0, 1, 1)  # global ranks 1 | 2 3
    assert all(c > 0 for c in consts[1:])
    assert all(r[4] == consts and r[5] == pick for r in results)
