"""Tensor (and sequence) parallelism in the trainer: the same model as one process, layout-free resume.

Every run trains the tiny GPT (or the tiny Llama) for 10 steps on the same global batch as the
single-process reference of tests/test_train.py; losses and final weights (gathered from the
tensor-parallel pieces) agree within 1e-5 (fp32; tensor-parallel reductions change the order of
additions).
"""

from __future__ import annotations

import json

import pytest

from tests.test_train import assert_same_training, run


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, cache_dir):
    return run(tmp_path_factory.mktemp("ref-tp"), cache_dir, "dp1", 1)


@pytest.mark.parametrize("name,nproc,overrides", [
    ("tp2", 2, {"parallel.tp": 2}),
    ("tp4", 4, {"parallel.tp": 4}),
    ("tp2-sp", 2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    ("tp2-dp2", 4, {"parallel.tp": 2}),
    ("tp2-selective", 2, {"parallel.tp": 2, "train.recompute": "selective"}),
])
def test_tensor_parallel_equals_one_process(single_process, tmp_path, cache_dir, name, nproc, overrides):
    result = run(tmp_path, cache_dir, name, nproc, **overrides)
    assert_same_training(result, single_process, atol=1e-5)


def test_llama_gqa_at_tp4_equals_one_process(tmp_path, cache_dir):
    """tiny-llama has 4 query heads and 2 key/value heads: at tp 4 each kv head is held by 2 ranks."""
    llama = {"model.preset": "tiny-llama", "train.steps": 6}
    ref = run(tmp_path, cache_dir, "llama1", 1, **llama)
    tp = run(tmp_path, cache_dir, "llama-tp4", 4, **llama, **{"parallel.tp": 4})
    assert_same_training(tp, ref, atol=1e-5)


@pytest.mark.parametrize("name,nproc,overrides", [
    ("tp2", 2, {"parallel.tp": 2}),
    ("tp2-sp", 2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    ("llama-tp4", 4, {"parallel.tp": 4, "model.preset": "tiny-llama"}),
])
def test_tp_bytes_are_counted_where_sent(tmp_path, cache_dir, name, nproc, overrides):
    """tp_sent_bytes per step, measured by the counting layer where each collective is called, equals
    the planner's prediction (plan --compare): Megatron's 4 all-reduces of b*s*h per layer per
    micro-batch (Shoeybi et al. 2019 §3) -- with sequence parallelism an all-gather and a reduce-scatter
    in place of each -- plus the embedding's g and the head's f and the loss's 3 all-reduces of one value
    per token, and the gradient all-reduces of the parameters tensor parallelism leaves partial (with
    SP the norms, row-parallel biases and position table; with tp > n_kv_heads the replicated k/v)."""
    from shardwise.config import Config
    from shardwise.plan.compare import measured_for_run, predicted_for_run

    run(tmp_path, cache_dir, name, nproc, **{"train.steps": 2, **overrides})
    cfg = Config.load(tmp_path / name / "config.toml")
    pred, meas = predicted_for_run(cfg), measured_for_run(tmp_path / name)
    assert pred["tp_sent_bytes"] == meas["tp_sent_bytes"], (pred["tp_sent_bytes"], meas["tp_sent_bytes"])
    assert meas["comm_bytes"] == meas["tp_sent_bytes"] == pred["comm_bytes"]  # dp 1: nothing else is sent
    if name == "tp2":  # spelled out once: (4 L + 2) activations of b*s*h fp32, and the loss's three
        tokens = cfg.train.global_batch * cfg.data.seq_len
        assert meas["tp_sent_bytes"] == (4 * cfg.model.n_layers + 2) * tokens * cfg.model.d_model * 4 + 3 * tokens * 4


TP2_PP2 = {"parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 4}


@pytest.mark.parametrize("first,then", [((2, {"parallel.tp": 2}), (2, {})), ((2, {}), (2, {"parallel.tp": 2})),
                                        ((4, TP2_PP2), (2, {"parallel.tp": 2}))])
def test_resume_across_tensor_parallel_layouts(single_process, tmp_path, cache_dir, first, then):
    """Stop a tp 2 run at step 6 and resume it as dp 2, the other way round, and tp 2 x pp 2 as tp 2:
    the checkpoint holds the single-process state, so the result equals an uninterrupted single process."""
    run(tmp_path, cache_dir, "resumed", first[0], stop_after=6, **{"ckpt.every": 3, **first[1]})
    result = run(tmp_path, cache_dir, "resumed", then[0], **{"ckpt.every": 3, "ckpt.resume": True, **then[1]})
    assert_same_training(([*single_process[0][:6], *result[0]], result[1], [*single_process[2][:6], *result[2]]),
                         single_process, atol=1e-5)


SP = {"parallel.sequence_parallel": True}
ZB = {"parallel.pp_schedule": "zb-h1"}
INTERLEAVED = {"parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2}
LLAMA_KV1 = {"model.preset": "tiny-llama", "model.n_kv_heads": 1}  # tp 2 > 1 kv head: both ranks hold it


@pytest.mark.parametrize("name,model,layout", [
    ("tp2-pp2", {}, {}),
    ("tp2-pp2-interleaved", {}, INTERLEAVED),
    ("tp2-pp2-sp-interleaved-noclip", {"train.grad_clip": 0}, {**SP, **INTERLEAVED}),
    ("llama-kv1-tp2-pp2-sp-zb-h1", LLAMA_KV1, {**SP, **ZB}),
])
def test_tensor_parallel_stages_equal_one_process(tmp_path, cache_dir, name, model, layout):
    """tp 2 x pp 2 (4 ranks): every stage is rewritten by the same parallelize() as a whole model; the
    tied GPT-2 table's gradient is exchanged between the first and last stage of each tensor-parallel
    rank (both hold the same vocabulary rows); the gradient norm counts owned pieces over tp and pp.
    With sequence parallelism stages exchange this rank's 1/tp of the tokens (Megatron's TP+SP+PP): the
    bytes sent equal the planner's pp_sent_bytes, half of the whole-sequence ones at tp 2. zb-h1 defers
    the column / row / vocabulary-parallel layers' weight gradients to its W actions, where the replicated
    key/value head's gradient hook (llama, tp 2 > n_kv_heads 1) sums the replicas' parts."""
    from shardwise.config import Config
    from shardwise.plan.compare import measured_for_run, predicted_for_run

    base = {"model.n_layers": 4, "train.steps": 6, **model}
    ref = run(tmp_path, cache_dir, "ref", 1, **base)
    pp = run(tmp_path, cache_dir, name, 4, **{"parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 4,
                                             **base, **layout})
    assert_same_training(pp, ref, atol=1e-5)
    cfg = Config.load(tmp_path / name / "config.toml")
    predicted, measured = predicted_for_run(cfg)["pp_sent_bytes"], measured_for_run(tmp_path / name)["pp_sent_bytes"]
    assert measured == predicted, (measured, predicted)
    if cfg.parallel.sequence_parallel:  # rank 0 sends (2v - 1) m activations of b (s / tp) h fp32, and its tied rows
        v, m = cfg.parallel.pp_virtual, cfg.parallel.microbatches
        message = cfg.train.micro_batch * cfg.data.seq_len // 2 * cfg.model.d_model * 4
        tied = -(-cfg.model.vocab_size // 2) * cfg.model.d_model * 4 if cfg.model.tie_embeddings else 0  # its rows
        assert measured == (2 * v - 1) * m * message + tied


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_over_tensor_parallel_pieces_equals_one_process(single_process, tmp_path, cache_dir, zero):
    """tp 2 x dp 2 with ZeRO-1/2/3 over the data-parallel ranks of each tensor-parallel piece: the flat
    shards hold slices of sliced weights; the norm counts owned pieces over dp then tp."""
    result = run(tmp_path, cache_dir, f"tp2-z{zero}", 4, **{"parallel.tp": 2, "parallel.zero": zero})
    assert_same_training(result, single_process, atol=1e-5)


def test_zero3_and_hpz_over_tensor_parallel_pieces_equal_one_process(single_process, tmp_path, cache_dir):
    """tp 2 x dp 2 with ZeRO-3, and with ZeRO++ hpZ (parallel.zero_hpz 2): hpZ's groups are consecutive ranks of
    each tensor-parallel rank's data-parallel group (not of the world, whose consecutive ranks are tp peers); a
    unit's secondary partition lives from its forward to its backward gather, so the rank's parameter bytes grow."""
    z3 = run(tmp_path, cache_dir, "tp2-z3", 4, **{"parallel.tp": 2, "parallel.zero": 3})
    hpz = run(tmp_path, cache_dir, "tp2-z3-hpz2", 4, **{"parallel.tp": 2, "parallel.zero": 3, "parallel.zero_hpz": 2})
    assert_same_training(z3, single_process, atol=1e-5)
    assert_same_training(hpz, single_process, atol=1e-5)
    params = [[r["mem_params_bytes"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").open())
               if "mem_params_bytes" in r][0] for name in ("tp2-z3", "tp2-z3-hpz2")]
    assert params[1] > params[0], params


def test_zero_tp_checkpoint_resumes_on_plain_data_parallel(single_process, tmp_path, cache_dir):
    """A tp 2 x dp 2 ZeRO-3 checkpoint (each rank writes the full-tensor runs its shard of its piece
    covers) resumes as plain dp 2, and equals an uninterrupted single process."""
    run(tmp_path, cache_dir, "resumed", 4, stop_after=6,
        **{"ckpt.every": 3, "parallel.tp": 2, "parallel.zero": 3})
    result = run(tmp_path, cache_dir, "resumed", 2, **{"ckpt.every": 3, "ckpt.resume": True})
    assert_same_training(([*single_process[0][:6], *result[0]], result[1], [*single_process[2][:6], *result[2]]),
                         single_process, atol=1e-5)


def _train_many(jobs):
    """Rank body: several trainer runs in one pool call; rank 0 returns their (losses, weights, grad norms)."""
    from tests.test_train import _train_on_rank

    return [_train_on_rank(cfg, run_dir) for cfg, run_dir in jobs]


def test_megatron_3d_layouts_equal_one_process(tmp_path, cache_dir):
    """tp 2 x pp 2 x dp 2 on 8 ranks, Megatron's GPT recipe: sequence parallelism inside the tensor-parallel
    pipeline and ZeRO-1 (the distributed optimizer), under 1F1B and under interleaved stages (virtual
    pipeline) with dropout 0.1 (masks drawn from the single-process positions), and 1F1B without dropout,
    clipping off: the same model as one process. The validation set is the same windows whatever the layout."""
    from tests.harness import run_on_ranks
    from tests.test_train import make_config

    base = {"model.n_layers": 4, "data.val_fraction": 0.1, "train.steps": 3, "train.grad_clip": 0}
    layout = {"parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 1, "parallel.microbatches": 4,
              "parallel.sequence_parallel": True}
    schedules = {"1f1b": {}, "interleaved": {"parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2}}
    jobs, refs = {}, {}
    for name, dropout in (("1f1b", 0.0), ("interleaved", 0.1)):
        refs[dropout] = run(tmp_path, cache_dir, f"ref-{dropout}", 1, **base, **{"model.dropout": dropout})
        run_dir = tmp_path / f"{name}-{dropout}"
        jobs[(name, dropout)] = (make_config(run_dir, cache_dir, 8, **base, **layout, **schedules[name],
                                             **{"model.dropout": dropout}), str(run_dir))
    results = run_on_ranks(8, _train_many, list(jobs.values()))[0]
    for (name, dropout), result in zip(jobs, results, strict=True):
        assert_same_training(result, refs[dropout], atol=1e-5)
        val = [[r["val_loss"] for r in map(json.loads, (tmp_path / d / "metrics.jsonl").open()) if "val_loss" in r]
               for d in (f"ref-{dropout}", f"{name}-{dropout}")]
        assert len(val[0]) == len(val[1]) == 2 and max(abs(a - b) for a, b in zip(*val, strict=True)) < 1e-5, val
