"""ZeRO inside pipelines: ZeRO-1/2/3 under every pipeline schedule train the same model as one process.

pp 2 x dp 2 on 4 gloo ranks, the tiny GPT with 4 blocks (tied table), global batch 8 as 4 micro-batches per
replica, 6 steps, fp32; the reference is one process with ``train.grad_accum`` 4. Every run of a world size
goes through one harness call (worker start-up dominates on 2 cores). Tolerances, stated once:

* losses and final weights within 1e-5, pre-clip gradient norms of every step within 1e-5 relative
  (:func:`tests.test_train.assert_same_training`): the two replicas' reduce-scatter adds in any order, but
  the global norm sums per-stage and per-shard squares in another order than one process, and clipping
  (1.0, on for ZeRO-1/2, off for the ZeRO-3 runs) scales by that norm;
* int8 gradients (ZeRO++ qgZ) round each rank's gradient once per step to 8 bits per 256-element block
  (an element moves by at most max|block| / 254): the first step's norm -- one rounding, nothing
  compounded yet -- within 1e-3 relative (measured 1.6e-4), every loss within 5e-3 (measured 2.2e-3), the
  weights within 3e-2 in relative L2 (measured 1.2e-2: Adam turns the rounding of a near-zero gradient
  element into a step of about lr).

The naive schedule is GPipe with one micro-batch, so it is not run apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.config import Config
from tests.harness import run_on_ranks
from tests.test_train import _train_on_rank, assert_same_training, make_config

STEPS = {"model.n_layers": 4, "train.steps": 6}
PIPE = {"parallel.pp": 2, "parallel.dp": 2, "parallel.microbatches": 4}
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved": {"parallel.pp_virtual": 2}, "zb-h1": {}}
SMALL_BUCKETS = {"parallel.bucket_mb": 0.01}  # several ZeRO-1/2 units per stage
NO_CLIP = {"train.grad_clip": 0}

RUNS = {
    **{f"z2-{s}": {"parallel.zero": 2, "parallel.pp_schedule": s, **SMALL_BUCKETS, **o} for s, o in SCHEDULES.items()},
    **{f"z3-{s}": {"parallel.zero": 3, "parallel.pp_schedule": s, **NO_CLIP, **o} for s, o in SCHEDULES.items()},
    "z1-interleaved-cpu": {"parallel.zero": 1, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2,
                           "parallel.offload": "cpu", **SMALL_BUCKETS},
    "z1-zb-h1-disk": {"parallel.zero": 1, "parallel.pp_schedule": "zb-h1", "parallel.offload": "disk",
                      **SMALL_BUCKETS, **NO_CLIP},
    "z1-1f1b-int8": {"parallel.zero": 1, "parallel.zero_quant_grads": True, **SMALL_BUCKETS, **NO_CLIP},
}
"""pp 2 x dp 2 runs: ZeRO-2 (clipping on) and ZeRO-3 (clipping off) under every schedule; ZeRO-1 with
interleaving and CPU offload, with zb-h1 and disk offload, with int8 gradients."""

SAVED = {"parallel.zero": 3, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2, **NO_CLIP,
         "ckpt.every": 3}
"""A ZeRO-3 interleaved run stopped after step 3; its checkpoint resumes on 2 plain data-parallel ranks."""


def _train_many(jobs):
    """Rank body: several trainer runs in a row; rank 0 returns their (losses, weights, grad norms)."""
    return [_train_on_rank(cfg, run_dir, stop) for cfg, run_dir, stop in jobs]


def _job(tmp: Path, cache_dir: Path, name: str, nproc: int, stop=None, **overrides):
    return make_config(tmp / name, cache_dir, nproc, **STEPS, **overrides), str(tmp / name), stop


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("pp-zero")
    spec = [_job(tmp, cache_dir, name, 4, **PIPE, **overrides) for name, overrides in RUNS.items()]
    spec.append(_job(tmp, cache_dir, "z3-saved", 4, stop=3, **PIPE, **SAVED))
    out = dict(zip([*RUNS, "z3-saved"], run_on_ranks(4, _train_many, spec)[0], strict=True))
    refs = [_job(tmp, cache_dir, name, 1, **{"train.grad_accum": 4}, **clip)
            for name, clip in (("ref", {}), ("ref-noclip", NO_CLIP))]
    resumed = _job(tmp, cache_dir, "z3-saved", 2, **NO_CLIP, **{"train.micro_batch": 2, "ckpt.every": 3,
                                                                 "ckpt.resume": True})
    out["ref"], out["ref-noclip"] = run_on_ranks(1, _train_many, refs)[0]
    out["resumed"] = run_on_ranks(2, _train_on_rank, *resumed[:2])[0]
    return out, tmp


def _reference(runs, name):
    """The one-process run with the same clipping."""
    return runs["ref-noclip" if "train.grad_clip" in RUNS[name] else "ref"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_under_every_schedule_equal_one_process(runs, stage):
    """ZeRO-2 / ZeRO-3 over the dp replicas of each stage, gradients accumulated unsharded and reduce-scattered
    once after the flush (ZeRO-3: the stage's units gathered from the first forward to the flush)."""
    runs = runs[0]
    for schedule in SCHEDULES:
        name = f"z{stage}-{schedule}"
        assert runs[name][0][-1] < runs[name][0][0] - 0.5, name
        assert_same_training(runs[name], _reference(runs, name), atol=1e-5)


@pytest.mark.parametrize("name", ["z1-interleaved-cpu", "z1-zb-h1-disk"])
def test_zero1_with_interleaving_zb_h1_and_offload_equals_one_process(runs, name):
    """Megatron's distributed optimizer with virtual stages (two chunks under one wrapper) and CPU offload;
    with zb-h1, whose W passes accumulate the linear layers' weight gradients after their B, and disk offload."""
    runs = runs[0]
    assert_same_training(runs[name], _reference(runs, name), atol=1e-5)


def test_zero2_reduces_each_chunk_during_its_last_backward(runs):
    """ZeRO-2 in a pipeline reduce-scatters units before the flush (parallel.zero_overlap_grad_reduce) where the
    schedule allows -- not zb-h1, whose weight gradients accumulate outside autograd -- and trains the same model
    (the equivalence test above)."""
    def reduced(name: str) -> float:
        rows = [json.loads(line) for line in (runs[1] / name / "metrics.jsonl").read_text().splitlines()]
        return [r["dp_reduced_in_backward"] for r in rows if "dp_reduced_in_backward" in r][-1]

    for name in ("z2-gpipe", "z2-1f1b", "z2-interleaved"):
        assert reduced(name) > 0, name
    assert reduced("z2-zb-h1") == 0


def test_zero1_with_int8_gradients(runs):
    """ZeRO++ qgZ inside a pipeline: close to one process within the rounding (module docstring), and the
    gradient bytes shrink: per step each replica reduce-scatters int8 (+ one fp32 scale per 256) instead of
    fp32 and all-gathers fp32 weights, 8 / (1 + 4/256 + 4) = 1.58x fewer data-parallel bytes."""
    runs, tmp = runs
    ours, ref = runs["z1-1f1b-int8"], runs["ref-noclip"]
    torch.testing.assert_close(torch.tensor(ours[2][0]), torch.tensor(ref[2][0]), rtol=1e-3, atol=0)
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(ref[0]), atol=5e-3, rtol=0)
    diff = sum(((ours[1][k] - ref[1][k]).double() ** 2).sum() for k in ref[1]).sqrt()
    norm = sum((ref[1][k].double() ** 2).sum() for k in ref[1]).sqrt()
    assert diff / norm < 3e-2
    ratio = _metric(tmp / "z1-zb-h1-disk", "dp_sent_bytes") / _metric(tmp / "z1-1f1b-int8", "dp_sent_bytes")
    assert 1.55 < ratio < 1.6, ratio


def test_zero3_pipeline_checkpoint_resumes_on_plain_data_parallelism(runs):
    """Every replica of every stage writes the slices of its shard under single-process names (interleaved
    chunks included); two plain data-parallel ranks continue the run."""
    runs = runs[0]
    ref = runs["ref-noclip"]
    assert runs["z3-saved"][0] == runs["z3-interleaved"][0][:3]
    assert_same_training(([*ref[0][:3], *runs["resumed"][0]], runs["resumed"][1]), ref, atol=1e-5)


def _metric(run_dir: Path, key: str) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = {r[key] for r in records if r.get("step", 0) >= 2 and key in r}
    assert len(values) == 1, (key, values)
    return values.pop()


@pytest.mark.parametrize("name", ["z2-1f1b", "z3-1f1b", "z3-interleaved", "z2-zb-h1"])
def test_plan_compare_equals_the_measured_bytes(runs, name, capsys):
    """``shardwise plan --compare`` on ZeRO-2/3 pipelines: rank 0's model-state bytes (its stages' padded
    units), what the flush holds (ZeRO-3's gathered stage, the unsharded gradients) and the bytes handed to
    collectives and sent on the wire (ZeRO-3: one gather and one reduce-scatter per unit and step) ==
    measured. ZeRO-3 holds half ZeRO-2's parameters between steps, and the whole stage at the flush."""
    from shardwise.plan.compare import compare_run, measured_for_run, predicted_for_run

    tmp = runs[1]
    pred, meas = predicted_for_run(Config.load(tmp / name / "config.toml")), measured_for_run(tmp / name)
    keys = ["mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_total_bytes", "mem_grad_accum_bytes",
            "comm_bytes", "comm_sent_bytes", "pp_sent_bytes"] + (["mem_gathered_bytes"] if name[1] == "3" else [])
    for key in keys:
        assert pred[key] == meas[key], (name, key, pred[key], meas[key])
    if name == "z3-1f1b":
        z2 = measured_for_run(tmp / "z2-1f1b")
        assert meas["mem_params_bytes"] * 2 == meas["mem_gathered_bytes"] == z2["mem_params_bytes"]
        assert meas["comm_bytes"] == z2["comm_bytes"]
    assert compare_run(tmp / name) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line}
    assert rows["mem_grad_accum_bytes"][-1] == "1.000"


def _middle_stage_on_one_rank():
    """Rank body: a middle stage (blocks only: no root unit) under ZeRO-3 in a pipeline step of two
    micro-batches gets the plain stage's accumulated gradients, and what the flush held is its units."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.parallel.pipeline import build_stage
    from shardwise.parallel.zero import ZeroDataParallel

    cfg = resolve(Config.load(overrides={"model.preset": "tiny", "model.n_layers": "3"}), world_size=1,
                  tokenizer_vocab=256).model
    plain, sharded = (build_stage(cfg, 1, 3, range(1, 2), seed=0) for _ in range(2))
    engine = ZeroDataParallel(sharded, stage=3)
    assert engine.root is None and len(engine.units) == 1
    xs = torch.randn(2, 2, 8, cfg.d_model, generator=torch.Generator().manual_seed(0))
    with engine.pipeline_step():
        for x in xs:
            sharded(x).square().mean().backward()
            assert engine.units[0].gathered  # kept to the flush
    for x in xs:
        plain(x).square().mean().backward()
    engine.reduce_gradients()
    assert not engine.units[0].gathered
    assert engine.flush_bytes == {"gathered": engine.units[0].padded_numel * 4,
                                  "grad_accum": engine.units[0].padded_numel * 4}
    expected = dict(plain.named_parameters())
    names = dict(zip(map(id, engine.units[0].params), engine.units[0].names, strict=True))
    for grad, p in engine.grad_pieces():
        torch.testing.assert_close(grad, expected[names[id(p)]].grad.reshape(-1), rtol=0, atol=0)


def test_zero3_middle_stage_has_no_root_unit():
    run_on_ranks(1, _middle_stage_on_one_rank)
