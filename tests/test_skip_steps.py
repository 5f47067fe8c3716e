"""A bad step is skipped on every rank alike (shardwise.train.step_guard), and the run then equals one process
that skipped the same step: losses, pre-clip gradient norms and weights.

``run.fault nan_loss@S:rR`` makes rank R's loss of step S NaN (its gradients untouched); ``nan_grad@S:rR`` one
element of its gradient, after the reduction (so under plain data parallelism no other replica sees it). The
one-process reference gets the same fault on its only rank.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.harness import run_on_ranks
from tests.test_train import assert_same_training, make_config

STEPS, BAD = 4, 2
DENSE = {"train.steps": STEPS}
MOE = {"train.steps": STEPS, "model.preset": "tiny-moe", "model.moe_router": "sigmoid_bias"}
"""Routers with balancing biases: a skipped step must leave them as it leaves the weights."""


def _train_every_rank(cfg, run_dir: str):
    """(losses, final weights on rank 0, pre-clip grad norms, skipped steps, printed lines) as each rank saw them."""
    import contextlib
    import io

    import torch.distributed as dist

    from shardwise.train.loop import train

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train(cfg, Path(run_dir), collect_state=True)
    state = result.state_dict if dist.get_rank() == 0 else {}
    return result.losses, state, result.grad_norms, result.skipped_steps, printed.getvalue().splitlines()


def _run(tmp_path: Path, cache_dir: Path, name: str, nproc: int, **overrides) -> list[tuple]:
    cfg = make_config(tmp_path / name, cache_dir, nproc, **overrides)
    return run_on_ranks(nproc, _train_every_rank, cfg, str(tmp_path / name))


def _without_the_skipped_step(result: tuple) -> tuple:
    """``(losses, weights, pre-clip norms)`` of the applied steps (the skipped step's loss is NaN, or its norm)."""
    losses, state, norms, *_ = result
    kept = [i for i in range(STEPS) if i != BAD - 1]
    return [losses[i] for i in kept], state, [norms[i] for i in kept]


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache_dir):
    """One process with each fault on its only rank (MoE: the micro-batches of one ep rank, as its aux loss
    is a mean per micro-batch)."""
    tmp = tmp_path_factory.mktemp("skip-ref")
    return {
        ("dense", "nan_grad"): _run(tmp, cache_dir, "grad", 1, **DENSE, **{"run.fault": f"nan_grad@{BAD}:r0"})[0],
        ("dense", "nan_loss"): _run(tmp, cache_dir, "loss", 1, **DENSE, **{"run.fault": f"nan_loss@{BAD}:r0"})[0],
        ("moe", "nan_loss"): _run(tmp, cache_dir, "moe", 1, **MOE, **{"run.fault": f"nan_loss@{BAD}:r0",
                                                                         "train.micro_batch": 4})[0],
    }


@pytest.mark.parametrize(("name", "model", "kind", "layout"), [
    ("dp2", "dense", "nan_grad", {}),  # rank 1's gradient only: rank 0's norm stays finite
    ("tp2", "dense", "nan_loss", {"parallel.tp": 2}),  # tp rank 1's copy of the loss, which no sum counts
    ("pp2", "dense", "nan_grad", {"parallel.pp": 2, "parallel.microbatches": 2}),
    ("zero3-dp2", "dense", "nan_grad", {"parallel.zero": 3}),
    ("ep2", "moe", "nan_loss", {"parallel.ep": 2}),  # sigmoid-bias routers: their biases stay too
])
def test_a_bad_step_is_skipped_on_every_rank(references, tmp_path, cache_dir, name, model, kind, layout):
    over = {**(MOE if model == "moe" else DENSE), **layout, "run.fault": f"{kind}@{BAD}:r1"}
    results = _run(tmp_path, cache_dir, name, 2, **over)
    assert [r[3] for r in results] == [[BAD], [BAD]], "every rank skips the same step"
    line = next(ln for ln in results[0][4] if f"step {BAD} skipped" in ln)
    assert "on every rank" in line and "(1 consecutive" in line, line
    if kind == "nan_loss":
        assert "non-finite loss on rank 1" in line, line
    ref = references[(model, kind)]
    assert math.isnan(results[0][0][BAD - 1]) == math.isnan(ref[0][BAD - 1]) == (kind == "nan_loss")
    assert_same_training(_without_the_skipped_step(results[0]), _without_the_skipped_step(ref), atol=1e-5)


def _skipped_step_changes_nothing(zero: int):
    """Rank body: one applied AdamW step, then one with a NaN gradient and the skip flag set (as the step guard
    hands it): the weights and the optimizer state (moments, step counts) are as they were, under plain replicas
    and under ZeRO (each rank's master slices)."""
    import copy

    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer
    from shardwise.parallel.data import DataParallel
    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer, full_model_state
    from shardwise.train.optim import build_optimizer
    from shardwise.train.step_guard import step_optimizer

    cfg = resolve(Config.load(overrides={"model.preset": "tiny", "model.vocab_size": "64"}), world_size=2,
                  tokenizer_vocab=64)
    model = Transformer(cfg.model)
    model.reset_parameters(1)
    if zero:
        wrapper = ZeroDataParallel(model, stage=zero)
        optimizer = ZeroOptimizer(wrapper, build_optimizer(model, cfg.train))
    else:
        wrapper = DataParallel(model)
        optimizer = build_optimizer(model, cfg.train)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))

    def state():
        weights = full_model_state(wrapper) if zero else model.state_dict()
        return copy.deepcopy((weights, optimizer.state_dict()["state"]))

    for skip in (0.0, 1.0):
        before = state()
        wrapper(x, x).backward()
        pieces = wrapper.grad_pieces()
        pieces[0][0].view(-1)[0] = float("nan") if skip else pieces[0][0].view(-1)[0]
        step_optimizer(optimizer, torch.tensor(skip))
        optimizer.zero_grad()
    after = state()
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert before[1], "the optimizer has state to compare"


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_skipped_step_changes_no_weight_and_no_optimizer_state(zero):
    run_on_ranks(2, _skipped_step_changes_nothing, zero)


def test_the_schedule_bias_and_scale_do_not_move_on_a_skip():
    from shardwise.config import Config
    from shardwise.model.router import Router, update_expert_bias
    from shardwise.train.optim import DeviceLrSchedule, lr_at
    from shardwise.train.precision import DynamicLossScaler

    tcfg = Config.load(overrides={"train.steps": "10", "train.warmup_steps": "3", "train.min_lr": "1e-4"}).train
    schedule, opt = DeviceLrSchedule(tcfg, torch.device("cpu")), torch.optim.AdamW([torch.zeros(1)], fused=True)
    lr = schedule.set(opt, 5, skipped=torch.tensor(2.0))  # steps 0..4 with two skipped: the 4th applied step
    assert float(lr) == lr_at(3, tcfg) and float(opt.param_groups[0]["lr"]) == lr_at(3, tcfg)
    router = Router(8, 4, kind="sigmoid_bias")
    load = torch.tensor([9.0, 1.0, 3.0, 3.0])
    update_expert_bias(router, load, 0.01, skipped=torch.tensor(1.0))
    assert torch.equal(router.expert_bias, torch.zeros(4))
    update_expert_bias(router, load, 0.01, skipped=torch.tensor(0.0))
    assert torch.equal(router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))  # the mean load is 4
    scaler = DynamicLossScaler(2.0**4, growth_interval=1)
    scaler.update(torch.tensor(1.0))
    assert scaler.scale == 2.0**3  # an overflow backs off on the device, from the same flag on every rank


def _train_or_error(cfg, run_dir: str):
    """Like :func:`_train_every_rank`, or the one line the run stopped with."""
    from shardwise.train.step_guard import SkippedStepsError

    try:
        return _train_every_rank(cfg, run_dir)
    except SkippedStepsError as e:
        return str(e)


def test_max_skipped_steps_stops_the_run_keeping_the_last_good_checkpoint(tmp_path, cache_dir):
    fault = {**DENSE, "run.fault": f"nan_loss@{BAD}:r0", "ckpt.every": 1, "ckpt.keep": 5}
    goes_on = _run(tmp_path, cache_dir, "on", 1, **fault)[0]  # the default allows 20 in a row
    assert goes_on[3] == [BAD] and any("checkpoint 2 not written" in ln for ln in goes_on[4])
    cfg = make_config(tmp_path / "stop", cache_dir, 1, **fault, **{"train.max_skipped_steps": 1})
    (message,) = run_on_ranks(1, _train_or_error, cfg, str(tmp_path / "stop"))
    assert message == (f"stopped at step {BAD}: 1 consecutive steps skipped (train.max_skipped_steps=1); the last "
                       f"applied step is {BAD - 1}, and no checkpoint was written after it. Lower train.lr, use "
                       "train.grad_clip or look for bad data")
    saved = sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())
    assert saved == [f"step_{BAD - 1:08d}"]


def test_skip_grad_norm_above_skips_spikes(tmp_path, cache_dir):
    over = {**DENSE, "train.steps": 2}
    plain = _run(tmp_path, cache_dir, "plain", 1, **over)[0]
    assert plain[3] == [] and plain[2][0] > 1.0
    guarded = _run(tmp_path, cache_dir, "guarded", 1, **over, **{"train.skip_grad_norm_above": plain[2][0] / 2})[0]
    assert guarded[3] == [1, 2], "the untrained model's norm is above the threshold at every step"
    assert any("above train.skip_grad_norm_above" in ln for ln in guarded[4]), guarded[4]
    _, initial, *_ = _run(tmp_path, cache_dir, "initial", 1, **over, **{"train.max_skipped_steps": 0,
                                                                          "train.skip_grad_norm_above": 1e-9})[0]
    for key, value in guarded[1].items():
        assert torch.equal(value, initial[key]), key


def test_fp16_backs_off_on_every_rank_from_the_same_verdict(tmp_path, cache_dir):
    """Rank 1's gradient overflows after the reduction: rank 0 found no overflow of its own, yet skips and halves
    its loss scale too (the scaler's flag is the step's verdict), so the ranks' scales never drift apart."""
    from shardwise.train.metrics import read_metrics

    results = _run(tmp_path, cache_dir, "fp16", 2, **{**DENSE, "train.steps": 3, "train.precision": "fp16",
                                                       "run.fault": f"nan_grad@{BAD}:r1"})
    assert [r[3] for r in results] == [[BAD], [BAD]]
    scales = [r["loss_scale"] for r in read_metrics(tmp_path / "fp16") if "loss_scale" in r]
    assert scales == [2.0**16, 2.0**15, 2.0**15]
