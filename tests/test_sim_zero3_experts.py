"""The simulator's ZeRO-3 step under expert parallelism is the engine's: the same units, gathered and reduce-scattered
in the same order over the same groups (expert units over their replicas, ``edp``; the rest over dp x cp).

The engine itself runs here, on one process: :func:`shardwise.sim.mirror.mirror_mesh` gives rank 0 of the layout
process groups that answer at once, so a step of the real :class:`~shardwise.train.engine.Engine` records which
units its hooks gather and reduce-scatter, and over how many ranks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from shardwise.dist.mesh import ParallelDims
from shardwise.sim.hardware import build_hardware
from shardwise.sim.mirror import mirror_mesh
from shardwise.sim.network import Fabric
from shardwise.sim.params import EMBED, HEAD, state_bytes
from shardwise.sim.simulate import load_config, simulate
from shardwise.sim.step import StepBuilder
from shardwise.train.engine import Engine
from tests.test_sim import FixedCosts, cluster, run


def engine_collectives(cfg, micro_batches: int) -> tuple[list[list[str]], list[tuple], int]:
    """The engine's ZeRO units (parameter names), its step's collectives ``(kind, unit, group, ranks, bytes,
    piece)`` and the most bytes its hpZ secondary partitions held (measured from their storages)."""
    p = cfg.parallel
    log: list[tuple] = []
    with mirror_mesh(ParallelDims(dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep)) as mesh, tempfile.TemporaryDirectory() as tmp:
        engine = Engine(cfg, mesh, torch.device("cpu"), Path(tmp))
        zero = engine.wrapper
        gather, launch = zero._gather, zero._launch

        piece = [EMBED]  # the piece computing (forward) or about to (backward) when a hook fires
        engine.module.register_forward_pre_hook(lambda *_: piece.__setitem__(0, EMBED), prepend=True)
        for i, block in enumerate(engine.module.blocks):
            block.register_forward_pre_hook(lambda *_, i=i: piece.__setitem__(0, i), prepend=True)
            block.register_forward_hook(lambda _m, _a, out, i=i: out.register_hook(  # runs before ZeRO's own
                lambda _g: piece.__setitem__(0, i)) and None, prepend=True)

        def record(kind, unit, from_node=False):
            group, ranks = ("hpz", zero.hpz.size) if from_node else \
                ("dp_cp" if unit.group is zero.group else "edp", unit.world)
            at = piece[0] if kind != "reduce-scatter" else None  # (the order places those)
            log.append((kind, unit.index, group, ranks, 4.0 * unit.shard_numel * unit.world, at))

        def gathering(unit, wait=True):
            if not unit.gathered and unit.gather_work is None:
                from_node = zero._in_backward and unit.secondary is not None  # hpZ: from the secondary partitions
                record("gather bwd" if zero._in_backward else "gather", unit, from_node)
            return gather(unit, wait)

        def launching(unit, flat):
            record("reduce-scatter", unit)
            return launch(unit, flat)

        zero._gather, zero._launch = gathering, launching
        gen = torch.Generator().manual_seed(0)
        shape = (cfg.train.micro_batch, cfg.data.seq_len)
        batches = [(torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
                    torch.randint(0, cfg.model.vocab_size, shape, generator=gen)) for _ in range(micro_batches)]
        engine.schedule.run(batches, None)
        return [sorted(u.names) for u in zero.units], log, zero.hpz.peak_bytes


def simulated_collectives(builder: StepBuilder) -> list[tuple]:
    """The simulated step's ZeRO-3 gathers and reduce-scatters: ``(kind, unit, group, ranks, bytes, piece)``,
    ``piece`` (gathers) the one whose forward or backward runs next after the computation the gather follows."""
    pieces = builder.pieces(0)
    out = []
    for t in builder.graph.tasks:
        if not t.name.startswith(("gather ", "reduce-scatter u")):
            continue
        kind = "reduce-scatter" if t.name.startswith("reduce") else "gather bwd" if " bwd " in t.name else "gather"
        after = t.deps[0] if t.deps else None  # the computation it is issued after (none: the step's start)
        done = after.name.split(" ", 1)[1] if after is not None else None
        done = int(done) if done is not None and done.isdigit() else done
        if kind == "gather":
            at = EMBED if after is None or after.kind == "B" else pieces[pieces.index(done) + 1]
        elif kind == "gather bwd":
            at = HEAD if after.kind == "F" else pieces[pieces.index(done) - 1]
        else:
            at = None
        group = t.args["group"]
        ranks = builder.cfg.parallel.zero_hpz if group == "hpz" else builder.dims.size(group)
        out.append((kind, t.args["unit"], group, ranks, t.nbytes, at))
    return out


@pytest.mark.parametrize("layout", [
    {"parallel.dp": "4", "parallel.ep": "2"},
    {"parallel.dp": "4", "parallel.ep": "2", "parallel.zero_unit": "2"},  # two blocks a unit, their experts apart
    {"parallel.dp": "2", "parallel.cp": "2", "parallel.ep": "2", "train.global_batch": "8"},  # ep over cp
    {"parallel.dp": "4", "parallel.ep": "2", "parallel.zero_hpz": "2"},  # dense units regathered in the node
])
def test_zero3_with_experts_simulates_the_engines_collectives(layout):
    """tiny-moe (two MoE blocks), ZeRO-3, two micro-batches: the simulator's units are the engine's, and its
    gathers (forward, backward) and reduce-scatters come in the engine's order, each over as many ranks as the
    engine's (2 for an expert unit: its replicas; 4 for the rest) and of the engine's padded size."""
    hw = build_hardware("H100", 1, 4)
    cfg = load_config(None, {"model.preset": "tiny-moe", "data.seq_len": "32", "train.precision": "fp32",
                             "parallel.zero": "3", "train.global_batch": "16", "train.micro_batch": "2",
                             "model.moe_d_ff": "33", **layout}, hw)  # experts' slices padded over 2 ranks, not 4
    assert cfg.train.grad_accum == 2
    builder = StepBuilder(cfg, Fabric(hw), FixedCosts(cfg, hw))  # (the order does not depend on the costs)
    assert builder.build().run() > 0
    units, engine, secondary = engine_collectives(cfg, cfg.train.grad_accum)
    rp = builder.params[0]
    assert [sorted(rp.names[i] for i in g) for g in rp.groups] == units
    assert simulated_collectives(builder) == engine
    assert {group for _, _, group, *_ in engine} >= {"dp_cp", "edp"}
    if cfg.parallel.zero_hpz > 1:  # the secondary partitions the simulator adds to the states are the engine's
        states = simulate(cfg, hw).ranks[0].states_bytes["params"] - state_bytes(cfg, rp)["params"]
        assert states == secondary > 0


def test_expert_units_are_exchanged_pairwise_on_gloo():
    """On gloo the engine's ZeRO collectives are its direct exchanges (``parallel/zero/exchange.py``) for every
    unit, the expert units over their replicas included: costed so, never as the backend's collective."""
    _, builder = run(cluster(gpus=4, backend="gloo"), {"model.preset": "tiny-moe", "parallel.zero": "3",
                                                       "parallel.ep": "2", "train.global_batch": "8"})
    assert {"edp pairwise", "dp_cp pairwise"} <= set(builder.algorithms)
    assert not any(k.startswith("edp") and not k.endswith("pairwise") for k in builder.algorithms)
