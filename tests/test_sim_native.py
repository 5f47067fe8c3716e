"""The backend's own collectives costed from their measured lines (``[sim.native_collectives]``), and the
transfers the engine makes itself.

A collective the engine hands to the backend is costed by the hardware's line for its collective and group size
when there is one, by the algorithm on the links when not; one of ours on point-to-point messages (pipeline
sends, ZeRO's exchanges on gloo, a non-native gradient all-reduce) never by the line.
"""

from __future__ import annotations

import pytest

from shardwise.config import ConfigError
from shardwise.sim.compute import BlockCost, PassCost
from shardwise.sim.hardware import NativeLine, build_hardware
from shardwise.sim.network import Fabric
from shardwise.sim.simulate import load_config
from shardwise.sim.step import StepBuilder
from tests.test_sim import FixedCosts, cluster, run

TABLE = """
[sim]
backend = "gloo"

[sim.native_collectives.all-reduce]
2 = { alpha_us = 500.0, gbps = 0.25, max_error = 0.1 }

[sim.native_collectives.all-gather]
2 = { alpha_us = 40.0, gbps = 2.0 }
"""


def test_the_table_is_read_and_costs_native_calls_only(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text(TABLE)
    hw = build_hardware("A100", 1, 4, path)
    assert hw.native_line("all-reduce", 2) == NativeLine("all-reduce", 2, 500e-6, 1 / 0.25e9, 0.1)
    assert hw.native_line("all-reduce", 4) is None and hw.native_line("reduce-scatter", 2) is None
    fab, plain = Fabric(hw), Fabric(hw.replace(native_collectives=()))
    nbytes = 1 << 20
    pair, four = [[0, 1], [2, 3]], [[0, 1, 2, 3]]
    assert fab.time("all-reduce", pair, nbytes, native=True) == (pytest.approx(500e-6 + nbytes / 0.25e9), "native")
    # not handed to the backend, or no line for the group size: the algorithm, as without a table
    assert fab.time("all-reduce", pair, nbytes) == plain.time("all-reduce", pair, nbytes)
    assert fab.time("all-reduce", four, nbytes, native=True) == plain.time("all-reduce", four, nbytes)
    assert fab.time("reduce-scatter", pair, nbytes, native=True) == plain.time("reduce-scatter", pair, nbytes)


@pytest.mark.parametrize("bad, message", [
    ("[sim.native_collectives.broadcast]\n2 = { alpha_us = 1.0, gbps = 1.0 }", "broadcast is not a collective"),
    ("[sim.native_collectives.all-reduce]\n2 = { alpha_us = 1.0 }", r"must be \{ alpha_us"),
    ("[sim.native_collectives.all-reduce]\n1 = { alpha_us = 1.0, gbps = 1.0 }", "group size >= 2"),
    ("[sim.native_collectives.all-reduce]\n2 = { alpha_us = 1.0, gbps = 0.0 }", "gbps one > 0"),
])
def test_a_bad_table_is_one_line_naming_the_entry(tmp_path, bad, message):
    path = tmp_path / "hw.toml"
    path.write_text(bad + "\n")
    with pytest.raises(ConfigError, match=message):
        build_hardware("A100", 1, 2, path)


def _slow_all_reduce(hw, seconds: float):
    return hw.replace(native_collectives=(NativeLine("all-reduce", 2, seconds, 0.0),))


def test_tensor_parallel_all_reduces_take_the_line():
    """tp 2 without overlap: every all-reduce of the step is the backend's, so a line of 1 s adds, per call,
    1 s minus what the ring charged; the calls counted from the simulated step itself."""
    hw = cluster(gpus=2, overlap=False)
    base, _ = run(hw, {"parallel.tp": "2", "train.global_batch": "8"})
    slow, builder = run(_slow_all_reduce(hw, 1.0), {"parallel.tp": "2", "train.global_batch": "8"})
    calls = round(slow - base)
    # one micro-batch, 2 blocks of 2 forward (rowwise) + 2 backward (regions); the embedding's forward, the
    # vocabulary-parallel loss's 3, the head's backward (it enters the region); the grad norm's over tp (the
    # loop's loss all-reduce is over dp = 1: none)
    assert calls == 2 * 4 + 1 + 3 + 1 + 1
    assert builder.algorithms["tp all-reduce"] == "native"


@pytest.mark.parametrize("algorithm, native", [("native", True), ("ring", False)])
def test_gradient_buckets_follow_comm_algorithm(algorithm, native):
    """dp 2: the buckets' all-reduce is the backend's only under comm.algorithm "native"; the loop's loss
    all-reduce always is."""
    hw = cluster(gpus=2, overlap=False)
    over = {"train.global_batch": "8", "comm.algorithm": algorithm}
    base, builder = run(hw, over)
    slow, _ = run(_slow_all_reduce(hw, 1.0), over)
    buckets = len(builder.params[0].groups)
    assert round(slow - base) == 1 + (buckets if native else 0)


def test_pipeline_sends_and_zero_exchanges_on_gloo_are_ours():
    """Point-to-point work never takes a collective's line: pp 2's activations, ZeRO-3's exchanges on gloo."""
    hw = cluster(gpus=2, overlap=False, backend="gloo")
    lines = tuple(NativeLine(c, 2, 1.0, 0.0) for c in ("all-gather", "reduce-scatter", "all-to-all"))
    for over in ({"parallel.pp": "2", "parallel.microbatches": "2", "train.global_batch": "4"},
                 {"parallel.zero": "3", "train.global_batch": "4"}):
        base, builder = run(hw, over)
        slow, _ = run(hw.replace(native_collectives=lines), over)
        assert slow == pytest.approx(base, abs=1e-9), over
    assert "dp_cp pairwise" in builder.algorithms  # ZeRO on gloo: direct exchanges, not a ring
    # its "had a gradient" flags go by our ring too: of its all-reduces only the loss's and the grad norm's are native
    zero = {"parallel.zero": "3", "train.global_batch": "4"}
    base, _ = run(hw, zero)
    slow, _ = run(_slow_all_reduce(hw, 1.0), zero)
    assert round(slow - base) == 2


def test_without_a_table_every_collective_is_costed_by_its_algorithm():
    step, builder = run(cluster(gpus=2), {"parallel.tp": "2", "train.global_batch": "8"})
    assert step > 0 and "native" not in builder.algorithms.values()


@pytest.mark.parametrize("algorithm, native", [("native", True), ("ring", False)])
def test_expert_all_to_all_follows_comm_algorithm(algorithm, native):
    """ep 2: the experts' all-to-all is the backend's under comm.algorithm "native", ours (pairwise) otherwise."""
    hw = cluster(gpus=2, overlap=False, backend="gloo")
    over = {"model.n_experts": "4", "parallel.ep": "2", "train.global_batch": "8", "comm.algorithm": algorithm}
    base, _ = run(hw, over)
    slow, _ = run(hw.replace(native_collectives=(NativeLine("all-to-all", 2, 1.0, 0.0),)), over)
    # per MoE block (both, one micro-batch): forward the split sizes and the tokens out and back, backward two
    assert round(slow - base) == (2 * 5 if native else 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_ring_attention_transfers_hide_behind_the_block_pairs_only_with_overlap(overlap):
    """cp 2, ring: a K/V transfer shorter than a block pair's compute is hidden where communication overlaps
    computation, and costs all its time where it does not (the hardware files of CPU ranks)."""
    hw = cluster(gpus=2, overlap=overlap)
    cfg = load_config(None, {"model.preset": "tiny", "data.seq_len": "64", "train.precision": "fp32",
                             "parallel.cp": "2", "train.global_batch": "8"}, hw)

    class SlowCore(FixedCosts):
        def core_cost(self):
            return BlockCost(PassCost(1.0), PassCost(2.0))

    builder = StepBuilder(cfg, Fabric(hw), SlowCore(cfg, hw))
    exposed = {label: s for label, _, s in builder.layers.segments(0, "F")}["cp ring (exposed)"]
    m, c = cfg.model, builder.costs
    kv = 2 * c.batch * m.n_kv_heads * c.tokens * (m.d_model // m.n_heads) * 4
    assert exposed == (0.0 if overlap else pytest.approx(builder.comm("cp", "send-ring", kv)))
