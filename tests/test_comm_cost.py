"""The cost model: classic step/byte counts, bytes actually sent, calibration and choice."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.dist.comm.cost import CostModel, calibration_sizes, cost, fit_line
from tests.harness import run_on_ranks

S = 1 << 20


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_classic_counts(n):
    lg = int(math.log2(n))
    ring = cost("all_reduce", "ring", S, n)
    assert (ring.steps, ring.bytes) == (2 * (n - 1), 2 * (n - 1) / n * S)
    rab = cost("all_reduce", "rabenseifner", S, n)
    assert (rab.steps, rab.bytes) == (2 * lg, 2 * (n - 1) / n * S)
    rd = cost("all_reduce", "recursive_doubling", S, n)
    assert (rd.steps, rd.bytes) == (lg, lg * S)
    assert cost("all_reduce", "tree", S, n).steps == 2 * lg
    for coll, alg in [("reduce_scatter", "ring"), ("all_gather", "ring"), ("all_to_all", "pairwise")]:
        c = cost(coll, alg, S, n)
        assert (c.steps, c.bytes) == (n - 1, (n - 1) / n * S)
    for coll, alg in [("reduce_scatter", "halving"), ("all_gather", "doubling")]:
        c = cost(coll, alg, S, n)
        assert (c.steps, c.bytes) == (lg, (n - 1) / n * S)
    assert cost("broadcast", "tree", S, n).steps == lg
    for coll in ("gather", "scatter"):
        c = cost(coll, "tree", S, n)
        assert (c.steps, c.bytes) == (lg, (n - 1) / n * S)
    assert cost("barrier", "dissemination", 0, n).steps == lg


def test_non_power_of_two_pays_the_fold():
    c = cost("all_reduce", "rabenseifner", S, 6)
    assert c.steps == 2 * 2 + 2 and c.bytes == 2 * 3 / 4 * S + 2 * S


def test_choice_follows_latency_and_bandwidth():
    # alpha-dominated small messages favour few steps; beta-dominated large ones bandwidth-optimal algorithms.
    m = CostModel(alpha=1e-4, beta=1e-9, gamma=1e-10, world_size=8)
    ours = ("ring", "rabenseifner", "recursive_doubling", "tree", "naive", "star")
    assert m.choose("all_reduce", 64, ours) == "recursive_doubling"
    assert m.choose("all_reduce", 256 << 20, ours) in ("ring", "rabenseifner")
    assert m.choose("all_reduce", 256 << 20, ("ring", "rabenseifner")) == "rabenseifner"  # fewer steps, same bytes
    m.native["all_reduce"] = (0.0, 0.0)  # an infinitely fast native: always chosen
    assert m.choose("all_reduce", 256 << 20) == "native"


def test_fit_line_weighs_relative_error():
    xs = [8.0, 65536.0, 1 << 20, 16 << 20]
    a, b = fit_line(xs, [1e-4 + 1e-9 * x for x in xs])
    assert a == pytest.approx(1e-4) and b == pytest.approx(1e-9)
    # one point 10x off: the fit stays a line through the others' neighbourhood, not pulled by the big values
    times = [1e-4 + 1e-9 * x for x in xs]
    times[0] *= 10
    assert fit_line(xs, times)[1] == pytest.approx(1e-9, rel=0.5)
    assert fit_line([1.0, 2.0], [2.0, 1.0]) == (pytest.approx(1.2), 0.0)  # never a negative slope
    assert calibration_sizes(8, 4 << 20) == [8, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def test_copies_cost_delta():
    m = CostModel(alpha=1e-5, beta=1e-9, gamma=1e-10, world_size=4, delta=1e-9)
    assert cost("all_reduce", "naive", S, 4).copied == 5 * S and cost("all_reduce", "ring", S, 4).copied == 0
    assert m.predict("all_reduce", "naive", S) - CostModel(1e-5, 1e-9, 1e-10, 4).predict("all_reduce", "naive", S) \
        == pytest.approx(5 * S * 1e-9)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_total_bytes_and_the_shared_host(n):
    for alg in ("ring", "rabenseifner", "tree", "star", "hierarchical", "torus"):
        assert cost("all_reduce", alg, S, n).total == 2 * (n - 1) * S, alg  # each contribution there and back once
    assert cost("all_reduce", "naive", S, n).total == n * (n - 1) * S
    # on one host, a tree's bytes cost what a ring's do (the same total); across hosts its critical path
    links, host = CostModel(0.0, 1e-9, 0.0, n), CostModel(0.0, 1e-9, 0.0, n, shared_host=True)
    assert host.predict("all_reduce", "tree", S) == pytest.approx(host.predict("all_reduce", "ring", S))
    assert links.predict("all_reduce", "tree", S) > links.predict("all_reduce", "ring", S)
    assert host.predict("all_reduce", "ring", S) == pytest.approx(links.predict("all_reduce", "ring", S))


def _sent_bytes(world: int) -> list[tuple[str, float, float]]:
    """Bytes each algorithm actually sends (max over ranks) next to the model's ``sent``."""
    import torch.distributed as dist

    from shardwise.dist.comm import (
        ALGORITHMS,
        CommStats,
        all_gather,
        all_reduce,
        all_to_all,
        gather,
        reduce_scatter,
        scatter,
    )

    n_el = 64 * world * 4  # divisible by every block count used
    nbytes = n_el * 4
    out = []

    def measure(name, call):
        stats = CommStats()
        call(stats)
        t = torch.tensor([float(stats.bytes_sent)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        coll, alg = name.split("/")
        out.append((name, float(t), cost(coll, alg, nbytes, world, node_size=2).sent))

    for alg in ("ring", "rabenseifner", "recursive_doubling", "torus", "naive", "star", "tree", "hierarchical"):
        measure(f"all_reduce/{alg}", lambda s, a=alg: all_reduce(torch.ones(n_el), algorithm=a, stats=s, node_size=2))
    for alg in ALGORITHMS["reduce_scatter"][1:]:
        measure(f"reduce_scatter/{alg}", lambda s, a=alg: reduce_scatter(torch.empty(n_el // world), torch.ones(n_el),
                                                                         algorithm=a, stats=s))
    for alg in ALGORITHMS["all_gather"][1:]:
        measure(f"all_gather/{alg}", lambda s, a=alg: all_gather(torch.empty(n_el), torch.ones(n_el // world),
                                                                 algorithm=a, stats=s))
    measure("all_to_all/pairwise", lambda s: all_to_all(torch.empty(n_el), torch.ones(n_el), stats=s))
    root = dist.get_rank() == 0
    measure("gather/tree", lambda s: gather(torch.ones(n_el // world), torch.empty(n_el) if root else None,
                                            algorithm="tree", stats=s))
    measure("scatter/tree", lambda s: scatter(torch.empty(n_el // world), torch.ones(n_el) if root else None,
                                              algorithm="tree", stats=s))
    return out


def _calibrate_and_choose() -> tuple[list[float], list[str]]:
    from shardwise.dist.comm.cost import calibrate

    m = calibrate(reps=2, large=1 << 20)
    picks = [m.choose("all_reduce", s) for s in (4096, 1 << 20, 16 << 20)]
    return [m.alpha, m.beta, m.gamma, *m.native["all_reduce"]], picks


@pytest.mark.parametrize("world", [4])
def test_bytes_sent_match_the_model(world):
    for name, measured, predicted in run_on_ranks(world, _sent_bytes, world, timeout=300)[0]:
        assert measured == pytest.approx(predicted), name


def test_calibrate_then_choose_agree_on_every_rank():
    results = run_on_ranks(2, _calibrate_and_choose, timeout=300)
    (consts, picks), (consts1, picks1) = results
    assert consts == consts1 and picks == picks1, "every rank must hold the same model and make the same choice"
    alpha, beta, gamma, native_latency, native_slope = consts
    assert alpha > 0 and beta > 0 and gamma > 0  # measurements: only their signs are stable on a shared machine
    assert native_latency >= 0 and native_slope >= 0
