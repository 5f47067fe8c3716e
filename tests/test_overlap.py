"""Communication overlapped with computation: every overlapped path computes what the plain one does.

* tensor / sequence parallelism decomposed with its matmuls (``parallel.tp_comm_overlap``,
  :mod:`shardwise.parallel.tensor.overlap`): the layers against the plain collectives on 2 and 4 ranks
  (forward and every gradient, fp32: within 1e-6 -- the matmuls are cut by rows, the partial sums added in
  rank order), and the trainer against one process (1e-5) with and without sequence parallelism, under
  tp x dp with ZeRO-3 and tp x pp;
* ZeRO-1/2's parameter all-gather after the step overlapped with the next forward
  (``parallel.zero_overlap_param_gather``): each module's forward finds its own units gathered while later
  units are still in flight, and training is bit-identical (atol 0) to waiting for every gather;
* ZeRO-1/2's reduce-scatter during backward on the CPU too (``parallel.zero_overlap_grad_reduce``): a
  reduce-scatter is in flight while backward goes on, and training is bit-identical to waiting at once
  (with gradient accumulation); in pipelines see tests/test_pipeline_zero.py;
* the gradient reduction dtype (``parallel.grad_reduce_dtype``): bf16 halves the bytes of the reduction and
  trains within bf16's rounding of the fp32 run;
* the exposed communication each rank measures per axis (``<axis>_exposed_s``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_on_ranks
from tests.test_train import _train_on_rank, assert_same_training, make_config

STEPS = {"train.steps": 4}
EXACT = {"train.grad_clip": 0}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("overlap-token-cache")


def _train_many(jobs):
    return [_train_on_rank(cfg, run_dir, None) for cfg, run_dir in jobs]


def _jobs(tmp: Path, cache_dir: Path, nproc: int, runs: dict) -> list:
    return [(make_config(tmp / name, cache_dir, nproc, **STEPS, **ov), str(tmp / name)) for name, ov in runs.items()]


def _last(run_dir: Path, key: str) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r][-1]


# ---- tensor parallelism: the decomposed layers ------------------------------------------------------------


def _tp_layers(sequence_parallel: bool):
    """Rank body: a column-parallel region (two projections) and a row-parallel projection, overlapped and
    plain, on the same inputs; the largest difference of outputs and gradients."""
    import torch.distributed as dist

    from shardwise.dist.comm.counting import CommStats
    from shardwise.parallel.tensor.layers import ColumnParallelLinear, EnterRegion, RowParallelLinear
    from shardwise.parallel.tensor.overlap import OverlappedRegion

    n, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(n)))
    torch.manual_seed(0)
    d, hidden, t = 8, 4 * n, 4 * n
    q, k, out = torch.nn.Linear(d, hidden), torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)
    x_full = torch.randn(2, t, d)
    x = x_full.chunk(n, dim=1)[rank] if sequence_parallel else x_full
    results, stats = [], {}
    for overlap in (False, True):
        stats[overlap] = CommStats()
        kw = {"sequence_parallel": sequence_parallel}
        region = OverlappedRegion(group, stats[overlap], sequence_parallel) if overlap else None
        cq = ColumnParallelLinear.from_linear(q, group, stats[overlap], enter_region=False, region=region, **kw)
        ck = ColumnParallelLinear.from_linear(k, group, stats[overlap], enter_region=False, region=region, **kw)
        row = RowParallelLinear.from_linear(out, group, stats[overlap], overlap=overlap, **kw)
        inp = x.clone().requires_grad_()
        entry = region or EnterRegion(group, stats[overlap], sequence_parallel)
        h = entry(None, (inp,))[0]
        y = row(torch.tanh(cq(h)) * ck(h))
        if region is not None:
            region.leave(None, None, None)
        y.square().sum().backward()
        results.append([y.detach(), inp.grad] + [p.grad for m in (cq, ck, row) for p in m.parameters()])
    diff = max((a - b).abs().max().item() for a, b in zip(*results, strict=True))
    return diff, stats[False].handed, stats[True].handed, stats[True].messages


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_decomposed_tp_layers_equal_the_plain_collectives(world, sp):
    for diff, plain, overlapped, messages in run_on_ranks(world, _tp_layers, sp):
        assert diff < 1e-6
        assert overlapped == plain  # the same vectors handed to the axis, whichever way they travel
        assert messages == (4 * (world - 1) if sp else 0)  # gather, scatter, and their adjoints: n - 1 steps each


# ---- the trainer -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """One process, and every overlapped layout of 2 and 4 ranks (one harness call per world size)."""
    tmp = tmp_path_factory.mktemp("overlap")
    one = run_on_ranks(1, _train_many, _jobs(tmp, cache_dir, 1, {"one": {}, "one_exact": EXACT}))[0]
    two = {
        "tp-sp": {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True},
        "tp": {"parallel.tp": 2, "parallel.tp_comm_overlap": True},
        "z1-wait": {"parallel.zero": 1, "parallel.zero_overlap_param_gather": False,
                    "parallel.zero_overlap_grad_reduce": False, **EXACT},
        "z1": {"parallel.zero": 1, **EXACT},
        "z2-acc-wait": {"parallel.zero": 2, "train.micro_batch": 2, "parallel.zero_overlap_param_gather": False,
                        "parallel.zero_overlap_grad_reduce": False, **EXACT},
        "z2-acc": {"parallel.zero": 2, "train.micro_batch": 2, **EXACT},
        "dp": EXACT,
        "dp-bf16": {"parallel.grad_reduce_dtype": "bf16", **EXACT},
        "z2-bf16": {"parallel.zero": 2, "parallel.grad_reduce_dtype": "bf16", **EXACT},
    }
    two_res = run_on_ranks(2, _train_many, _jobs(tmp, cache_dir, 2, two))[0]
    four = {
        "tp-sp-z3": {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True,
                     "parallel.zero": 3},
        "tp-sp-pp": {"parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": True,
                     "parallel.tp_comm_overlap": True, "parallel.microbatches": 4},
    }
    four_res = run_on_ranks(4, _train_many, _jobs(tmp, cache_dir, 4, four))[0]
    out = dict(zip(["one", "one_exact"], one, strict=True))
    out.update(zip(two, two_res, strict=True))
    out.update(zip(four, four_res, strict=True))
    return out, tmp


@pytest.mark.parametrize("name", ["tp-sp", "tp", "tp-sp-z3", "tp-sp-pp"])
def test_overlapped_tensor_parallelism_equals_one_process(runs, name):
    assert_same_training(runs[0][name], runs[0]["one"], atol=1e-5)


def test_overlapped_tp_hands_the_same_bytes_as_predicted(runs):
    """The decomposed collectives hand the axis what the plain ones would (the planner's ``tp_sent_bytes``),
    and with sequence parallelism they travel as counted point-to-point messages."""
    from shardwise.config import Config
    from shardwise.plan.compare import measured_for_run, predicted_for_run

    tmp = runs[1]
    for name in ("tp-sp", "tp"):
        pred = predicted_for_run(Config.load(tmp / name / "config.toml"))
        assert measured_for_run(tmp / name)["tp_sent_bytes"] == pred["tp_sent_bytes"], name
    assert _last(tmp / "tp-sp", "comm_backend_bytes") < _last(tmp / "tp-sp", "tp_sent_bytes")


@pytest.mark.parametrize("name", ["z1", "z2-acc"])
def test_zero_overlaps_are_bit_identical_to_waiting(runs, name):
    """Overlapped gathers and reduce-scatters compute exactly what waiting for each does, and equal one process."""
    assert_same_training(runs[0][name], runs[0][f"{name}-wait"], atol=0)
    assert_same_training(runs[0][name], runs[0]["one_exact"], atol=1e-5)


@pytest.mark.parametrize("name", ["dp-bf16", "z2-bf16"])
def test_bf16_gradient_reduction(runs, name):
    """Half the bytes on the data-parallel axis' reduction; the training of the fp32 reduction within bf16's
    rounding (2^-8 relative per element, before Adam's normalisation)."""
    results, tmp = runs
    fp32 = "dp" if name == "dp-bf16" else "z2-acc"
    assert_same_training(results[name], results[fp32], atol=5e-2, norm_rtol=1e-2)
    assert results[name][2] != results[fp32][2]  # it is not the fp32 reduction
    sent, base = _last(tmp / name, "dp_sent_bytes"), _last(tmp / fp32, "dp_sent_bytes")
    if name == "dp-bf16":  # the all-reduce of every bucket, halved
        assert sent == base / 2
    else:  # the reduce-scatter halved, the parameter all-gather as before: 3/4
        assert sent == pytest.approx(0.75 * base, rel=1e-3)


def test_exposed_communication_is_measured_per_axis(runs):
    tmp = runs[1]
    assert _last(tmp / "tp-sp", "tp_exposed_s") > 0  # the region's entries and exits wait for their last chunk
    assert _last(tmp / "z1", "dp_exposed_s") > 0  # the "had a gradient" flags' all-reduce blocks
    assert _last(tmp / "tp-sp-pp", "pp_exposed_s") >= 0


# ---- ZeRO: what overlaps what ---------------------------------------------------------------------------


def _zero_timing(stage: int, overlap: bool):
    """Rank body: a few ZeRO steps of the tiny GPT with small buckets, observing (1) at each module's forward
    whether its own units are gathered and how many later units are still in flight, (2) after each gradient
    hook, whether a reduce-scatter is in flight."""
    import torch.distributed as dist

    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer
    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer

    cfg = resolve(Config.load(overrides={"model.preset": "tiny"}), world_size=dist.get_world_size(),
                  tokenizer_vocab=256)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.reset_parameters(0)
    engine = ZeroDataParallel(model, stage=stage, bucket_mb=0.02, overlap_reduce=overlap, overlap_param_gather=overlap)
    opt = ZeroOptimizer(engine, torch.optim.AdamW(model.parameters(), lr=1e-3))
    seen = {"missing": 0, "in_flight_at_forward": 0, "in_flight_in_backward": 0}

    def check(module, _args):
        units = {id(engine._unit_of[id(p)]): engine._unit_of[id(p)] for p in module._parameters.values()
                 if p is not None and id(p) in engine._unit_of}
        seen["missing"] += sum(u.gather_work is not None for u in units.values())
        seen["in_flight_at_forward"] = max(seen["in_flight_at_forward"], engine.pending_param_gathers())

    for m in model.modules():  # after the engine's own pre-hooks
        m.register_forward_pre_hook(check)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: seen.__setitem__(
            "in_flight_in_backward", max(seen["in_flight_in_backward"], len(engine._inflight))))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        engine(x, x).backward()
        opt.step()
        opt.zero_grad()
    assert len(engine.units) > 2  # several units: a forward can run beside later units' gathers
    return seen


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_forward_waits_for_its_own_units_only(stage):
    for seen in run_on_ranks(2, _zero_timing, stage, True):
        assert seen["missing"] == 0  # no module ran on parameters still in flight
        assert seen["in_flight_at_forward"] > 0  # ... while later units' gathers were
        assert seen["in_flight_in_backward"] >= 1  # and a reduce-scatter travelled beside backward
    for seen in run_on_ranks(2, _zero_timing, stage, False):
        assert seen["missing"] == seen["in_flight_at_forward"] == seen["in_flight_in_backward"] == 0


# ---- the simulator models the same overlaps, from the same code -------------------------------------------


def _sim(hw, overrides):
    from tests.test_sim import run as run_sim

    return run_sim(hw, {"train.global_batch": "8", "train.micro_batch": "4", "parallel.bucket_mb": "0.02",
                        **overrides})


def test_sim_zero_param_gather_overlaps_the_next_forward():
    """With the overlap each bucket's all-gather runs on the data-parallel stream from the step's start and a
    piece's forward waits only for its own buckets; without it the gathers block after the optimizer."""
    from tests.test_sim import cluster

    hw = cluster(gpus=2)
    on, b_on = _sim(hw, {"parallel.zero": "1"})
    off, b_off = _sim(hw, {"parallel.zero": "1", "parallel.zero_overlap_param_gather": "false"})
    gathers = [t for t in b_on.graph.tasks if t.name.startswith("all-gather bucket")]
    assert len(gathers) == len(b_on.params[0].groups) > 2 and all(t.stream == "dp" for t in gathers)
    assert all(t.stream == "compute" for t in b_off.graph.tasks if t.name.startswith("all-gather bucket"))
    first = next(t for t in b_on.graph.tasks if t.kind == "F")
    assert any(t.end > first.start for t in gathers)  # later buckets still travel while the forward runs
    assert on < off


def test_sim_zero_reduce_waits_as_the_engine_does():
    """On gloo hardware ZeRO-2 now overlaps its reduce-scatters (the engine's overlaps_reduce); with the field off
    the backward waits for each."""
    from tests.test_sim import cluster

    hw = cluster(gpus=2, backend="gloo")
    _, on = _sim(hw, {"parallel.zero": "2"})
    _, off = _sim(hw, {"parallel.zero": "2", "parallel.zero_overlap_grad_reduce": "false"})
    assert not any(t.name.startswith("wait bucket") for t in on.graph.tasks)
    assert any(t.name.startswith("wait bucket") for t in off.graph.tasks)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("zero", [0, 2])
def test_sim_pipeline_data_parallelism_reduces_before_the_flush(schedule, zero):
    """pp 2 x dp 2, plain and ZeRO-2: buckets are all-reduced (reduce-scattered) once their chunk's last backward
    has run (before the rank's last computation ends), as the executor's last_backward_actions say -- not with
    zb-h1. Untied embeddings: the tied table's bucket, and those after it, wait for the flush."""
    from tests.test_sim import cluster

    _, b = _sim(cluster(gpus=4), {"parallel.zero": str(zero), "parallel.pp": "2", "parallel.pp_schedule": schedule,
                                  "model.n_layers": "4", "model.tie_embeddings": "false",
                                  "parallel.bucket_mb": "0.05"})
    name = "reduce-scatter" if zero else "all-reduce bucket"
    for r, last in enumerate(b.last_compute):
        early = [t for t in b.graph.rank_tasks(r) if t.name.startswith(name) and t.start < last.end]
        assert bool(early) == (schedule == "1f1b"), r


def test_sim_tp_decomposition_hides_communication():
    """tp 4 with sequence parallelism on H100s: the engine's decomposed layers, run on the simulator's clock,
    leave less tensor-parallel communication exposed than the blocking collectives, and none of it is
    negative; every decomposed site of the block and the head is found."""
    from shardwise.sim.hardware import build_hardware
    from shardwise.sim.simulate import load_config, simulate

    hw = build_hardware("H100", 1, 8)
    base = {"model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": "2", "model.d_model": "1024",
            "model.n_heads": "16", "model.vocab_size": "32768", "data.seq_len": "2048", "model.max_seq_len": "2048",
            "train.precision": "bf16", "train.global_batch": "4", "train.micro_batch": "1", "parallel.tp": "4",
            "parallel.sequence_parallel": "true"}
    plain = simulate(load_config(None, base, hw), hw)
    over = simulate(load_config(None, {**base, "parallel.tp_comm_overlap": "true"}, hw), hw)
    assert 0 < over.exposed_s["tp"] < plain.exposed_s["tp"]
    assert over.step_time_s < plain.step_time_s
    from shardwise.sim.step import StepBuilder  # noqa: F401 - the layers' sites, as the builder found them
    from shardwise.sim.tp_overlap import decomposed_exposure

    cfg = load_config(None, {**base, "parallel.tp_comm_overlap": "true"}, hw)
    from shardwise.sim.costs import RankCosts

    sites = decomposed_exposure(cfg, RankCosts(cfg, hw).roofline, 1, lambda *a: 1e-4, overlap=True)
    assert set(sites) == {"blocks.0.attn.q_proj", "blocks.0.attn.o_proj", "blocks.0.mlp.fc_in",
                          "blocks.0.mlp.fc_out", "lm_head"}
    assert all(f >= 0 and b >= 0 for f, b in sites.values())


def _reduce_dtypes():
    """Rank body: ZeRO-2 with bf16 flat parameters and gradients, reduce-scattered in their own bf16 or in fp32
    (``reduce_dtype``, FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)): the slices, the fp32 sum of
    the ranks' bf16 gradients, and the bytes handed."""
    import torch.distributed as dist

    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer
    from shardwise.parallel.zero import ZeroDataParallel

    cfg = resolve(Config.load(overrides={"model.preset": "tiny"}), world_size=2, tokenizer_vocab=256)
    out = []
    for dtype in (None, torch.float32):
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        model.reset_parameters(0)
        engine = ZeroDataParallel(model, stage=2, param_dtype=torch.bfloat16, reduce_dtype=dtype)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine(x, x).backward()
        out.append(([g.clone() for g, _ in engine.grad_pieces()], engine.comm_stats.pop().handed))
    (bf16, handed_bf16), (fp32, handed_fp32) = out
    return max((a - b).abs().max().item() / b.abs().max().clamp_min(1e-12).item() for a, b in zip(bf16, fp32,
                                                                                                  strict=True)), \
        handed_fp32 - handed_bf16, sum(u.padded_numel * 2 for u in engine.units)


def test_fp32_reduction_of_bf16_gradients():
    """The gradient slices differ by bf16's rounding of the sum, and the reduce-scatter hands twice the bytes."""
    for rel, extra, bf16_bytes in run_on_ranks(2, _reduce_dtypes):
        assert 0 < rel < 2 ** -7
        assert extra == bf16_bytes
