"""The planner proposes only layouts the trainer runs: every layout of a real search over a mixture-of-experts model
is accepted by the trainer's config resolution, through the same translation ``plan --simulate-top`` uses.

Expert parallelism is where the two had drifted apart (the planner carved ep out of dp x cp, the trainer out of dp
alone); both now call :func:`shardwise.parallel.expert.checks.expert_parallel_error`."""

from __future__ import annotations

import functools
import typing

from shardwise.plan.cli import load_plan_inputs
from shardwise.plan.hardware import Cluster, find_gpu, load_catalogue
from shardwise.plan.memory import parse_state_dtypes
from shardwise.plan.search import search
from shardwise.sim.hardware import build_hardware
from shardwise.sim.planning import layout_overrides
from shardwise.sim.simulate import load_config


def test_every_layout_the_planner_proposes_for_experts_is_one_the_trainer_accepts(monkeypatch):
    """tiny-moe with 8 experts on one node of 8 GPUs, every layout field open but the micro-batch and the
    recomputation (they multiply the layouts without touching expert parallelism): each layout that fits resolves,
    among them ep groups spanning data- and context-parallel ranks (ep not dividing dp)."""
    # parsing a config's text looks up its section's type hints each time; they do not change: look once
    monkeypatch.setattr(typing, "get_type_hints", functools.cache(typing.get_type_hints))
    overrides = {"model.preset": "tiny-moe", "model.n_experts": "8", "data.seq_len": "64", "train.global_batch": "16",
                 "train.micro_batch": "1", "train.recompute": "none"}
    _, spec, seq_len, fixed, global_batch = load_plan_inputs(None, overrides)
    cluster = Cluster(find_gpu("H100", load_catalogue(None)), 8, 1, 0.5, 1.0, 0.0, "nccl")
    result = search(spec, seq_len, cluster, fixed, global_batch, parse_state_dtypes("shardwise"), "bf16", top=0)
    layouts = [c.layout for c in result.ranked]
    assert len(layouts) > 100 and {lay.ep for lay in layouts} == {1, 2, 4, 8}
    assert any(lay.dp % lay.ep for lay in layouts), "the search should reach ep groups across dp x cp"
    hw = build_hardware("H100", 1, 8)
    for lay in layouts:
        cfg = load_config(None, {**overrides, **layout_overrides(lay, "1f1b")}, hw)  # raises ConfigError if refused
        p = cfg.parallel
        assert (p.dp, p.cp, p.ep, p.zero) == (lay.dp, lay.cp, lay.ep, lay.zero)
