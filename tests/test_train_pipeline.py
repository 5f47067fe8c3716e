"""Pipeline parallelism inside the trainer: every schedule (zero-bubble ZB-H1 included) and pp x dp trains
the same model as one process.

The reference is a single process with the same global batch split into the same micro-batches
(``train.grad_accum`` = ``parallel.microbatches``). fp32 runs agree within 1e-5 (the global-norm clip
sums per-stage squares in another order); a stopped-and-resumed pipeline run is bit-identical, and its
layout-free checkpoint resumes on plain data parallelism.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from tests.test_train import assert_same_training, run

LAYERS = {"model.n_layers": 4, "train.steps": 6}



@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """One process, global batch 8 as 4 micro-batches of 2."""
    return run(tmp_path_factory.mktemp("ref"), cache_dir, "single", 1, **LAYERS, **{"train.grad_accum": 4})


@pytest.mark.parametrize(("nproc", "layout"), [
    (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    (2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "parallel.pp_partition": "1"}),
    (2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2}),
    (4, {"parallel.pp": 4, "parallel.pp_schedule": "1f1b"}),
    (4, {"parallel.pp": 2, "parallel.dp": 2, "parallel.pp_schedule": "1f1b", "parallel.bucket_mb": 0.05}),
    (2, {"parallel.pp": 2, "parallel.pp_schedule": "zb-h1"}),
], ids=["pp2-1f1b", "pp2-gpipe-manual", "pp2-interleaved", "pp4-1f1b", "pp2xdp2", "pp2-zb-h1"])
def test_pipeline_trains_like_one_process(reference, tmp_path, cache_dir, nproc, layout):
    micro = {"parallel.microbatches": 4} if "parallel.dp" not in layout else {"parallel.microbatches": 2}
    result = run(tmp_path, cache_dir, "pp", nproc, **LAYERS, **layout, **micro)
    assert_same_training(result, reference, atol=1e-5)
    if "parallel.dp" in layout:  # plain data parallelism all-reduces buckets during each chunk's last backward (the
        # tied table's after the flush: small buckets, so that others hold none of it)
        rows = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()]
        assert [r["dp_reduced_in_backward"] for r in rows if "dp_reduced_in_backward" in r][-1] > 0


def test_llama_untied_pipeline(tmp_path, cache_dir):
    llama = {"model.preset": "tiny-llama", "model.n_layers": 4, "train.steps": 4}
    ref = run(tmp_path, cache_dir, "ref", 1, **llama, **{"train.grad_accum": 2})
    pp = run(tmp_path, cache_dir, "pp", 2, **llama, **{"parallel.pp": 2, "parallel.microbatches": 2})
    assert_same_training(pp, ref, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_and_recompute_through_the_pipeline(tmp_path, cache_dir, precision):
    extra = {**LAYERS, "train.precision": precision, "train.recompute": "full"}
    ref = run(tmp_path, cache_dir, "ref", 1, **extra, **{"train.grad_accum": 4})
    pp = run(tmp_path, cache_dir, "pp", 2, **extra, **{"parallel.pp": 2, "parallel.microbatches": 4})
    # Not bit-equal: the fp32 master weights differ by ~1e-6 (the tied table's gradient is summed per
    # stage, the clip norm per stage), which flips a few bf16/fp16 roundings of the compute copies and
    # the sign of a few near-zero gradients in Adam's first steps. Measured: losses within 7.5e-5,
    # weights within 4e-4 of the reference in relative L2 norm (fp32: losses equal, weights within 2e-6).
    torch.testing.assert_close(torch.tensor(pp[0]), torch.tensor(ref[0]), atol=2e-4, rtol=0)
    diff = sum(((pp[1][k] - ref[1][k]).double() ** 2).sum() for k in ref[1]).sqrt()
    norm = sum((ref[1][k].double() ** 2).sum() for k in ref[1]).sqrt()
    assert diff / norm < 2e-3


def test_resume_is_bit_identical_and_layout_free(reference, tmp_path, cache_dir):
    pipe = {**LAYERS, "parallel.pp": 2, "parallel.microbatches": 4, "ckpt.every": 3}
    uninterrupted = run(tmp_path, cache_dir, "full", 2, **pipe)
    run(tmp_path, cache_dir, "resumed", 2, stop_after=3, **pipe)
    resumed = run(tmp_path, cache_dir, "resumed", 2, **pipe, **{"ckpt.resume": "true"})
    assert resumed[0] == uninterrupted[0][3:]
    for key, value in uninterrupted[1].items():
        assert torch.equal(value, resumed[1][key]), key
    # The same pipeline checkpoint resumed by two data-parallel replicas (pp=1) continues the same run.
    run(tmp_path, cache_dir, "moved", 2, stop_after=3, **pipe)
    moved = run(tmp_path, cache_dir, "moved", 2, **LAYERS, **{"train.micro_batch": 2, "ckpt.every": 3,
                                                             "ckpt.resume": "true"})
    assert_same_training(([0.0] * 3 + moved[0], moved[1]), ([0.0] * 3 + reference[0][3:], reference[1]), atol=1e-5)


def test_bubble_metrics_and_timeline(tmp_path, cache_dir):
    run(tmp_path, cache_dir, "pp", 2, **LAYERS, **{"parallel.pp": 2, "parallel.microbatches": 4})
    records = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bubble_theory"] == pytest.approx(1 / 5) for r in records if "loss" in r)
    # the measured timeline is gathered (a wait for the device) only on the steps that account memory
    steps = [r for r in records if "bubble" in r]
    assert [r["step"] for r in steps] == [1, 6]  # the first and the last of 6 (and every 10th)
    assert all(0.0 <= r["bubble"] < 1.0 for r in steps)
    assert all(0.0 <= r["bubble_replayed"] <= r["bubble"] for r in steps)  # communication only adds idle time
    assert all(r["pp_peak_live_0"] == 2 and r["pp_peak_live_1"] == 1 for r in steps)  # 1F1B: p - rank
    # Rank 0 (stage 0) sends 4 activations of [2, 32, 64] fp32 and its copy of the tied table's gradient
    # (vocabulary 257: 256 bytes + 1 special token).
    assert all(r["pp_sent_bytes"] == 4 * 2 * 32 * 64 * 4 + 257 * 64 * 4 for r in records if "loss" in r)
    doc = json.loads((tmp_path / "pp" / "timeline.json").read_text())
    assert doc["schedule"] == "1f1b" and len(doc["timelines"]) == 2

    from shardwise.cli import main

    assert main(["plot", "timeline", str(tmp_path / "pp")]) == 0
    assert (tmp_path / "pp" / "timeline.png").stat().st_size > 0
    trace = json.loads((tmp_path / "pp" / "timeline.trace.json").read_text())
    assert any(e.get("cat") == "F" for e in trace["traceEvents"])

    # ZB-H1 reports its own theory, (p - 1) / (3m + p - 1) with equal F, B, W, and W passes in the trace.
    run(tmp_path, cache_dir, "zb", 2, **LAYERS, **{"parallel.pp": 2, "parallel.microbatches": 4,
                                                   "parallel.pp_schedule": "zb-h1"})
    records = [json.loads(line) for line in (tmp_path / "zb" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bubble_theory"] == pytest.approx(1 / 13) for r in records if "loss" in r)
    doc = json.loads((tmp_path / "zb" / "timeline.json").read_text())
    assert any(e["kind"] == "W" for t in doc["timelines"] for e in t["events"])


@pytest.mark.parametrize(("overrides", "message"), [
    ({"parallel.pp": 2, "model.n_layers": 1}, "exceed model.n_layers=1"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2,
      "parallel.microbatches": 3, "train.global_batch": 6}, "not a multiple of parallel.pp=2"),
    ({"parallel.pp": 2, "parallel.microbatches": 3}, "not divisible"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "naive", "parallel.microbatches": 4}, "pp_schedule='naive'"),
    ({"parallel.pp": 2, "parallel.nproc": 4, "parallel.zero": 3, "parallel.zero_hpz": 2}, "no backward gather"),
    ({"parallel.pp": 2, "parallel.microbatches": 4, "train.grad_accum": 2}, "set only one of them"),
    ({"parallel.pp": 2, "parallel.pp_partition": "middle"}, "parallel.pp_partition='middle'"),
    ({"parallel.pp": 2, "parallel.pp_virtual": 2}, "needs pp_schedule='interleaved'"),
])
def test_bad_pipeline_configs_fail_before_spawning(overrides, message):
    base = {"model.preset": "tiny", "model.n_layers": 4, "parallel.nproc": 2, "train.global_batch": 8}
    base.update(overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        resolve(Config.load(overrides={k: str(v) for k, v in base.items()}), tokenizer_vocab=256)


def test_default_microbatches():
    cfg = resolve(Config.load(overrides={"model.preset": "tiny", "model.n_layers": "4", "parallel.nproc": "4",
                                 "parallel.pp": "2", "train.global_batch": "16"}), tokenizer_vocab=256)
    assert (cfg.parallel.dp, cfg.parallel.microbatches, cfg.train.micro_batch) == (2, 8, 1)  # 4p divides 8


def test_zero1_inside_a_pipeline_equals_one_process(tmp_path, cache_dir):
    """pp 2 x dp 2 with ZeRO-1 (Megatron's distributed optimizer: each replica of a stage steps 1/dp of
    its optimizer state after the flush, then gathers the parameters): the same model as one process;
    stopped at step 6, its checkpoint (every replica writes its shard's slices under single-process
    indices) resumes on plain data parallelism."""
    layers = {"model.n_layers": 4}
    ref = run(tmp_path, cache_dir, "ref", 1, **layers)
    pp = {"parallel.pp": 2, "parallel.zero": 1, "parallel.microbatches": 4, "parallel.bucket_mb": 0.01}
    assert_same_training(run(tmp_path, cache_dir, "pp2-z1", 4, **layers, **pp), ref, atol=1e-5)
    run(tmp_path, cache_dir, "resumed", 4, stop_after=6, **layers, **pp, **{"ckpt.every": 3})
    result = run(tmp_path, cache_dir, "resumed", 2, **layers, **{"ckpt.every": 3, "ckpt.resume": True})
    assert_same_training(([*ref[0][:6], *result[0]], result[1]), ref, atol=1e-5)
