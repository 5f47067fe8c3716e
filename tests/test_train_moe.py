"""Mixture of experts and expert parallelism in the trainer: the same model as one process.

The tiny MoE GPT (4 experts, top-2, every block) trains for a few steps on the global batch of
tests/test_train.py. The auxiliary losses are nonlinear in the set of tokens a router sees at once, so
the single-process reference accumulates the same micro-batches the data-parallel ranks hold
(``train.micro_batch`` = global batch / dp); losses and final weights (gathered from the expert
shards) agree within 1e-5 (fp32; all-to-all regrouping changes the order of additions).
"""

from __future__ import annotations

import pytest

from tests.test_train import assert_same_training, run

MOE = {"model.preset": "tiny-moe", "train.steps": 3}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """One process, accumulating micro-batches of 4 and of 2 (the shares of dp 2 and dp 4)."""
    tmp = tmp_path_factory.mktemp("ref-moe")
    out = {dp: run(tmp, cache_dir, f"ref{dp}", 1, **MOE, **{"train.micro_batch": 8 // dp}) for dp in (2, 4)}
    return {**out, "dirs": {dp: tmp / f"ref{dp}" for dp in (2, 4)}}


@pytest.mark.parametrize("name,nproc,overrides", [
    ("ep2", 2, {"parallel.ep": 2}),
    ("ep4", 4, {"parallel.ep": 4}),
    ("ep2-dp4", 4, {"parallel.ep": 2}),
    ("ep2-ours", 2, {"parallel.ep": 2, "comm.algorithm": "ring"}),
    ("zero3-ep1", 2, {"parallel.zero": 3}),  # experts not split: ZeRO-3 shards them like any weight
    ("ep2-recompute", 2, {"parallel.ep": 2, "train.recompute": "full"}),  # all-to-alls rerun in backward
    ("ep2-zero1", 2, {"parallel.ep": 2, "parallel.zero": 1}),  # experts sliced over edp (1 rank), dense over dp
    ("ep2-zero2-dp4", 4, {"parallel.ep": 2, "parallel.zero": 2}),  # experts sliced over their 2 replicas
    ("ep2-zero3-dp4", 4, {"parallel.ep": 2, "parallel.zero": 3}),  # a unit per block's experts, gathered inside
])
def test_expert_parallel_equals_one_process(reference, tmp_path, cache_dir, name, nproc, overrides):
    result = run(tmp_path, cache_dir, name, nproc, **MOE, **overrides)
    assert_same_training(result, reference[nproc], atol=1e-5)
    # one global gradient norm: every expert and dense piece (ZeRO slice or shard) counted once
    norms = grad_norms(tmp_path / name)
    assert len(norms) == 3 and norms == pytest.approx(grad_norms(reference["dirs"][nproc]), rel=1e-5)


@pytest.mark.parametrize("dispatch,factor", [("exchange", 1.0), ("padded", 1.0), ("padded", 2.0)])
def test_capacity_drops_are_the_same_on_one_rank_and_ep2(tmp_path, cache_dir, dispatch, factor):
    """With a capacity factor each rank drops the overflow of its own micro-batch before dispatch, exactly as
    the single process drops it from the same micro-batch: the same tokens are dropped, the same model trains --
    whether the kept tokens travel by uneven all-to-alls or padded to capacity (parallel.ep_dispatch). Factor 2
    (capacity = every token, top-2 of 4 experts) drops nothing: the padded dispatch equals the dropless model."""
    cf = {**MOE, "model.moe_capacity_factor": factor}
    ref = run(tmp_path, cache_dir, "cf-ref", 1, **cf, **{"train.micro_batch": 4})
    ep = run(tmp_path, cache_dir, "cf-ep2", 2, **cf, **{"parallel.ep": 2, "parallel.ep_dispatch": dispatch})
    assert_same_training(ep, ref, atol=1e-5)
    dropped = [m["moe_dropped_frac"] for m in read_metrics(tmp_path / "cf-ep2")]
    assert all(0 < d < 1 for d in dropped) if factor < 2 else dropped == [0, 0, 0], dropped
    assert dropped == pytest.approx([m["moe_dropped_frac"] for m in read_metrics(tmp_path / "cf-ref")], abs=1e-9)
    assert len(dropped) == 3


def test_llama_experts_with_shared_expert_ep2(tmp_path, cache_dir):
    """SwiGLU experts, a shared expert and MoE on every other block, at ep 2."""
    llama = {"model.preset": "tiny-llama", "model.n_experts": 4, "model.moe_shared": 1, "model.moe_every": 2,
             "train.steps": 3}
    ref = run(tmp_path, cache_dir, "llama-ref", 1, **llama, **{"train.micro_batch": 4})
    ep = run(tmp_path, cache_dir, "llama-ep2", 2, **llama, **{"parallel.ep": 2})
    assert_same_training(ep, ref, atol=1e-5)


@pytest.mark.parametrize("nproc,dp,overrides", [
    (2, 2, {}), (4, 2, {"parallel.tp": 2}), (4, 4, {"parallel.zero": 1}), (4, 4, {"parallel.zero": 3}),
    # experts split over tp as well: pieces of two splits (ep rows of tp columns), and ZeRO-1 slices of them
    (4, 2, {"parallel.tp": 2, "parallel.etp": 2, "parallel.zero": 1}),
], ids=["ep2", "ep2-tp2", "ep2-dp4-zero1", "ep2-dp4-zero3", "ep2-tp2-etp2-zero1"])
def test_ep2_checkpoint_resumes_on_one_process(reference, tmp_path, cache_dir, nproc, dp, overrides):
    """Checkpoints hold the single-process state: an ep-2 run stopped after 2 steps goes on in one process
    (with ZeRO-1 every rank writes its slices: dense ones of the dp group's, its experts' of the edp group's)."""
    ckpt = {**MOE, "ckpt.every": 2}
    run(tmp_path, cache_dir, "switch", nproc, stop_after=2, **ckpt, **{"parallel.ep": 2, **overrides})
    resumed = run(tmp_path, cache_dir, "switch", 1, **ckpt,
                  **{"train.micro_batch": 8 // dp, "ckpt.resume": "true"})
    losses, state, norms = reference[dp]
    assert_same_training(resumed, (losses[2:], state, norms[2:]), atol=1e-5)


def test_one_process_checkpoint_resumes_on_ep2_zero2(reference, tmp_path, cache_dir):
    """The other way: a single-process checkpoint resumes on 4 ranks with experts split over ep 2 and ZeRO-2
    slicing dense weights over dp 4 and expert weights over their 2 replicas."""
    ckpt = {**MOE, "ckpt.every": 2}
    run(tmp_path, cache_dir, "switch", 1, stop_after=2, **ckpt, **{"train.micro_batch": 2})
    resumed = run(tmp_path, cache_dir, "switch", 4, **ckpt,
                  **{"parallel.ep": 2, "parallel.zero": 2, "ckpt.resume": "true"})
    losses, state, norms = reference[4]
    assert_same_training(resumed, (losses[2:], state, norms[2:]), atol=1e-5)


def grad_norms(run_dir) -> list[float]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


def read_metrics(run_dir):
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "moe_dropped_frac" in r]


@pytest.mark.parametrize("layout", [
    {"parallel.zero": 0},
    {"parallel.zero": 1},
    {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
    {"parallel.cp": 2},
    {"parallel.tp": 2, "parallel.etp": 2},
], ids=["dp", "zero1", "tp2-sp", "cp2", "tp2-etp2"])
def test_ep_bytes_are_counted_where_sent(tmp_path, cache_dir, layout):
    """ep_sent_bytes per step, measured by the counting layer at each all-to-all, against the planner
    (plan --compare). Per MoE block and micro-batch a rank hands over: the n_experts int64 split sizes, its
    own routed rows (micro_batch x its tokens x top_k) twice (dispatch forward, combine backward) and the R rows
    its experts received twice (combine forward, dispatch backward). Its tokens: the sequence's 1/cp, and 1/tp
    more with sequence parallelism, whose ranks then add the router's counts (int64) and probability and z sums
    (n_experts + 1 fp32) per block; context parallelism adds the counts over cp. R depends on the routing: the
    planner predicts its mean over the ep group, so the measured bytes minus the exactly known part are a whole
    number of received rows, between 0 and ep times the balanced count. Everything else is predicted exactly:
    the data-parallel all-reduces (dense over dp, experts over their replicas), ZeRO-1's reduce-scatters and
    all-gathers and its flags, tensor parallelism's regions (attention only: a MoE block is whole on every tp
    rank) and its gradient sums (the experts' 1/ep under sequence parallelism), context parallelism's ring, and
    the model states per rank (the vocabulary-parallel table padded to equal pieces). With each expert split over
    tp (etp) the experts' f and g all-reduce exactly the R rows the ep bytes show arrived."""
    from shardwise.config import Config
    from shardwise.plan.compare import measured_for_run, predicted_for_run

    run(tmp_path, cache_dir, "bytes", 4, **{**MOE, "train.steps": 2, "parallel.ep": 2, **layout})
    cfg = Config.load(tmp_path / "bytes" / "config.toml")
    pred, meas = predicted_for_run(cfg), measured_for_run(tmp_path / "bytes")
    tp, cp, sp = cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.sequence_parallel
    experts, layers, row_bytes, ep = cfg.model.n_experts, cfg.model.n_layers, 64 * 4, 2
    micro_batch = 8 // (4 // (tp * cp))  # the global batch over dp
    rows = micro_batch * 32 // cp // (tp if sp else 1) * 2  # top-2
    router = (8 * experts + 4 * (experts + 1) if sp else 0) + (8 * experts if cp > 1 else 0)
    known = layers * (8 * experts + 2 * rows * row_bytes + router)
    assert pred["ep_sent_bytes"] == known + layers * 2 * rows * row_bytes  # balanced routing
    received, rest = divmod(meas["ep_sent_bytes"] - known, 2 * row_bytes)
    assert rest == 0 and 0 <= received <= layers * ep * rows
    assert pred["comm_bytes"] - pred["ep_sent_bytes"] - pred["tp_sent_bytes"] == \
        meas["comm_bytes"] - meas["ep_sent_bytes"] - meas.get("tp_sent_bytes", 0.0)
    if cfg.parallel.etp > 1:  # Megatron's f and g around this rank's experts: an all-reduce of the R rows each way
        balanced = layers * 2 * rows * row_bytes
        assert meas["tp_sent_bytes"] - (pred["tp_sent_bytes"] - balanced) == 2 * row_bytes * received
        assert pred["cp_sent_bytes"] == meas.get("cp_sent_bytes", 0.0)
    else:
        for key in ("tp_sent_bytes", "cp_sent_bytes"):
            assert pred[key] == meas.get(key, 0.0), key
    for key in ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes"):  # experts' memory per rank under ep
        assert pred[key] == meas[key], key


def test_ep2_with_tp2_equals_one_process(reference, tmp_path, cache_dir):
    """4 ranks as tp 2 x dp 2, experts split over ep 2: attention and the head are tensor-parallel, each MoE
    block is whole on both tp ranks (same tokens, same routing) with its experts split over ep."""
    result = run(tmp_path, cache_dir, "ep2-tp2", 4, **MOE, **{"parallel.tp": 2, "parallel.ep": 2})
    assert_same_training(result, reference[2], atol=1e-5)


def _experts_on_two_ranks(counts: list[int]):
    """ExpertParallel over the 2-rank world against the single-device Experts on both ranks' tokens."""
    import torch
    import torch.distributed as dist

    from shardwise.model.moe import Experts
    from shardwise.parallel.expert.dispatch import ExpertParallel

    torch.manual_seed(0)
    full = Experts(4, 8, 16, "gpt2")
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.5)
    xs = [torch.randn(sum(counts), 8) for _ in range(2)]  # every rank's tokens, the same everywhere
    ref = [full(x.requires_grad_(), counts) for x in xs]
    sum(r.pow(2).sum() for r in ref).backward()
    ep = ExpertParallel(full, dist.group.WORLD)
    mine = xs[dist.get_rank()].detach().requires_grad_()
    y = ep(mine, counts)
    y.pow(2).sum().backward()
    torch.testing.assert_close(y, ref[dist.get_rank()].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.grad, xs[dist.get_rank()].grad, atol=1e-5, rtol=1e-5)
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    for (_, p), (_, q) in zip(ep.named_parameters(), full.named_parameters(), strict=True):
        if q.grad[rows].abs().sum() == 0:
            assert p.grad is None or p.grad.abs().sum() == 0
        else:
            torch.testing.assert_close(p.grad, q.grad[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("counts", [[3, 1, 2, 2], [5, 3, 0, 0]], ids=["spread", "rank1-idle"])
def test_dispatch_and_combine_by_all_to_all_equal_one_device(counts):
    """Outputs, input gradients and expert gradients as the single-device experts give them, also when one
    rank's experts receive no token at all (its backward all-to-alls must still run, or the peer waits)."""
    from tests.harness import run_on_ranks

    run_on_ranks(2, _experts_on_two_ranks, counts)


@pytest.mark.parametrize("nproc,dp,overrides", [
    (2, 2, {"parallel.pp": 2, "parallel.microbatches": 2}),  # 8 sequences a replica: micro-batches of 4
    (4, 4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.microbatches": 2, "parallel.zero": 1}),  # pp2 x dp2 (ep2)
], ids=["pp2", "ep2-pp2-zero1"])
def test_moe_pipeline_equals_one_process(reference, tmp_path, cache_dir, nproc, dp, overrides):
    """MoE blocks on both stages: the first stage backpropagates its blocks' auxiliary losses with its output's
    gradient and the logged loss sums them over the stages, so losses and weights are the single process's
    (accumulating the same micro-batches) -- with the experts split over ep 2 and ZeRO-1 as well."""
    result = run(tmp_path, cache_dir, "moe-pp", nproc, **MOE, **overrides)
    assert_same_training(result, reference[dp], atol=1e-5)
    keys = ("moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max")
    assert grad_norms(tmp_path / "moe-pp") == pytest.approx(grad_norms(reference["dirs"][dp]), rel=1e-5)
    got, want = read_metrics(tmp_path / "moe-pp"), read_metrics(reference["dirs"][dp])
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):  # the routers' metrics join every stage's blocks
        assert [g[k] for k in keys] == pytest.approx([w[k] for k in keys], abs=1e-5)


MOE6 = {"model.preset": "tiny-moe", "model.n_layers": 4, "train.steps": 6, "train.micro_batch": 4}
"""Six steps at micro-batches of 4 (dp 2's share): long enough that some rank's local experts get no token in some
step -- they must still take their (zero-gradient) optimizer step as the single process's stacked tensor does."""


@pytest.fixture(scope="module")
def reference6(tmp_path_factory, cache_dir):
    """One process, per gradient clip (1.0, the default, and 0: off): (result, run directory)."""
    tmp, done = tmp_path_factory.mktemp("ref-moe6"), {}

    def get(clip: float):
        if clip not in done:
            done[clip] = run(tmp, cache_dir, f"ref-clip{clip}", 1, **MOE6, **{"train.grad_clip": clip}), \
                tmp / f"ref-clip{clip}"
        return done[clip]

    return get


@pytest.mark.parametrize("name,nproc,overrides", [  # micro-batches of 4 as the reference's (dp 2, or dp 1 with 2)
    ("ep2-noclip", 2, {"parallel.ep": 2, "train.grad_clip": 0}),
    ("ep2-tp2-sp", 4, {"parallel.ep": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}),
    ("cp2-ep2", 4, {"parallel.cp": 2, "parallel.ep": 2}),
    # expert tensor parallelism: every expert's hidden units split over tp, tokens replicated over tp
    ("tp2-etp2-noclip", 4, {"parallel.tp": 2, "parallel.etp": 2, "train.grad_clip": 0}),
    # ... with sequence parallelism (each tp rank's routed rows gathered over tp), experts over ep 2 and ZeRO-3
    ("ep2-tp2-etp2-sp-zero3", 4, {"parallel.ep": 2, "parallel.tp": 2, "parallel.etp": 2,
                                  "parallel.sequence_parallel": True, "parallel.zero": 3}),
    ("cp2-ep2-ulysses-noclip", 4, {"parallel.cp": 2, "parallel.ep": 2, "parallel.cp_algorithm": "ulysses",
                                   "train.grad_clip": 0}),
    # ZeRO-3 with hpZ: dense units keep secondary partitions over 2 consecutive dp x cp ranks; expert units,
    # sliced over their own replicas, gather from their primary slices
    ("cp2-ep2-zero3-hpz2", 4, {"parallel.cp": 2, "parallel.ep": 2, "parallel.zero": 3, "parallel.zero_hpz": 2}),
    # ep carved out of dp x cp, not dp alone: groups spanning both data-parallel replicas and context shards (dp
    # 2), and (dp 1) groups inside the context shards, ZeRO-3 slicing each expert unit over its 2 replicas (edp)
    ("cp2-ep4", 4, {"parallel.cp": 2, "parallel.ep": 4}),
    ("cp4-ep2-zero3", 4, {"parallel.cp": 4, "parallel.ep": 2, "parallel.zero": 3}),
])
def test_experts_with_every_axis_equal_one_process(reference6, tmp_path, cache_dir, name, nproc, overrides):
    """Experts under sequence parallelism (each tp rank routes its sequence shard; the router's and experts'
    partial gradients are summed over tp) and under context parallelism (each cp rank routes its share of
    the sequence; the load-balancing and z losses are the whole sequence's: routed counts summed over the
    ranks, probability sums taken as the language-model loss is), with the experts split over ep: the same
    model as one process (losses, pre-clip gradient norms, weights) and the same router metrics."""
    result = run(tmp_path, cache_dir, name, nproc, **MOE6, **overrides)
    ref, ref_dir = reference6(overrides.get("train.grad_clip", 1.0))
    assert_same_training(result, ref, atol=1e-5)
    for got, want in zip(read_metrics(tmp_path / name), read_metrics(ref_dir), strict=True):
        for key in ("moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got[key], want[key])
