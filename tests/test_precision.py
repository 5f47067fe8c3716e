"""Autocast contexts and the dynamic loss scaler (reference: torch.amp.GradScaler)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.train.precision import DynamicLossScaler, autocast_context, needs_loss_scaling


def test_autocast_dtypes_on_cpu():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast_context("bf16", "cpu"):
        assert (a @ b).dtype == torch.bfloat16
        assert nn.functional.linear(a, b.t()).dtype == torch.bfloat16
    with autocast_context("fp16", "cpu"):  # fp16 CPU autocast works in torch 2.13
        assert (a @ b).dtype == torch.float16
    with autocast_context("fp32", "cpu"):
        assert (a @ b).dtype == torch.float32
    with pytest.raises(ValueError, match="train.precision='fp8'"):
        autocast_context("fp8", "cpu")
    assert needs_loss_scaling("fp16") and not needs_loss_scaling("bf16")


def test_overflow_skips_step_and_backs_off():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=4)
    scaler.scale_loss((p * 2).sum()).backward()
    p.grad[1] = float("inf")
    found = scaler.unscale_([p])
    assert found
    if not found:
        opt.step()
    scaler.update(found)
    assert torch.equal(p.detach(), torch.ones(3))
    assert scaler.scale == 2.0**7

    p.grad = torch.tensor([0.0, float("nan"), 0.0])
    assert scaler.unscale_([p])


def test_growth_after_interval_and_min_scale():
    scaler = DynamicLossScaler(init_scale=4.0, growth_interval=3, min_scale=2.0)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    scaler.update(True)  # resets the counter
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 4.0
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 2.0


def test_unscale_is_exact_division_across_dtypes():
    torch.manual_seed(0)
    a = nn.Parameter(torch.zeros(100))
    b = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
    c = nn.Parameter(torch.zeros(2))  # no grad: skipped
    ga, gb = torch.randn(100), torch.randn(7).to(torch.bfloat16)
    scaler = DynamicLossScaler(init_scale=2.0**12)
    a.grad, b.grad = ga * scaler.scale, gb * scaler.scale
    assert not scaler.unscale_([a, b, c])
    assert torch.equal(a.grad, ga) and torch.equal(b.grad, gb) and c.grad is None
    assert torch.equal(a.grad, (ga * 2.0**12) / 2.0**12)


def test_matches_grad_scaler_trajectory():
    torch.manual_seed(0)
    x = torch.randn(16)
    ours_p = nn.Parameter(torch.randn(16))
    ref_p = nn.Parameter(ours_p.detach().clone())
    ours_opt = torch.optim.AdamW([ours_p], lr=1e-2)
    ref_opt = torch.optim.AdamW([ref_p], lr=1e-2)
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = DynamicLossScaler(**kw)
    ref = torch.amp.GradScaler("cpu", **kw)
    script = "ccc ocoo cccc ccc occ c o cccccc".replace(" ", "")  # c: clean step, o: injected overflow
    for i, event in enumerate(script):
        for param, opt, scale_fn in ((ours_p, ours_opt, ours.scale_loss), (ref_p, ref_opt, ref.scale)):
            opt.zero_grad(set_to_none=True)
            scale_fn(((param * x) ** 2).sum() * 1e-3).backward()
            if event == "o":
                param.grad[i % 16] = float("inf") if i % 2 else float("nan")
        found = ours.unscale_([ours_p])
        assert found == (event == "o")
        if not found:
            ours_opt.step()
        ours.update(found)
        ref.step(ref_opt)
        ref.update()
        assert ours.scale == ref.get_scale(), f"step {i}"
        assert torch.equal(ours_p, ref_p), f"step {i}"


def test_state_dict_round_trip_is_json():
    s = DynamicLossScaler(init_scale=2.0**5, growth_interval=2)
    s.update(True)
    s.update(False)
    state = json.loads(json.dumps(s.state_dict()))
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == s.state_dict()
    t.update(False)
    assert t.scale == 2.0**5  # growth counter was restored too
    with pytest.raises(ValueError, match="growth_tracker"):
        t.load_state_dict({k: v for k, v in state.items() if k != "growth_tracker"})
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_found_inf_agrees_across_ranks():
    """Two gloo ranks (threads sharing a HashStore): an overflow on one rank skips on both."""
    store = dist.HashStore()
    results: dict[int, object] = {}

    def rank_fn(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("scaler", store), rank, 2)
            p = nn.Parameter(torch.zeros(4))
            p.grad = torch.ones(4)
            if rank == 0:
                p.grad[2] = float("inf")
            results[rank] = DynamicLossScaler().unscale_([p], group=pg)
        except Exception as e:  # surfaced below
            results[rank] = e

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {0: True, 1: True}
