"""The experts' kernels (one grouped GEMM, a padded batched matmul, a loop) compute the same thing, keep every
expert weight in the graph, and the MoE block never reads a value back to the host in a training forward."""

from __future__ import annotations

import pytest
import torch

from shardwise.model.expert_matmul import PAD_ROWS_PER_EXPERT, Capability, ExpertRows, aligned, pick
from shardwise.model.moe import Experts, MoE, pop_moe_totals

COUNTS = [5, 0, 9, 2]
"""Rows per expert: expert 1 gets no token, so its weights' gradient must be zero, not missing."""


def _experts(flavor: str, kernel: str) -> Experts:
    torch.manual_seed(0)
    experts = Experts(len(COUNTS), 8, 12, flavor, kernel=kernel)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return experts


def _run(experts: Experts, x: torch.Tensor, grad: torch.Tensor | None):
    x = x.detach().requires_grad_()
    y = experts(x, torch.tensor(COUNTS))
    if grad is None:
        y.sum().backward()  # an expanded (stride 0) gradient: the grouped GEMM's backward refuses those
    else:
        y.backward(grad)
    return y.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}


@pytest.mark.parametrize("flavor", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("kernel", ["grouped", "padded"])
def test_kernels_equal_the_loop_and_give_every_expert_a_gradient(flavor, kernel):
    x = torch.randn(sum(COUNTS), 8)
    for grad in (torch.randn(sum(COUNTS), 8), None):
        y0, gx0, gw0 = _run(_experts(flavor, "loop"), x, grad)
        y1, gx1, gw1 = _run(_experts(flavor, kernel), x, grad)
        torch.testing.assert_close(y1, y0, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(gx1, gx0, atol=1e-6, rtol=1e-6)
        for name, g in gw1.items():
            assert g is not None, f"{kernel}: {name} left out of the graph"
            torch.testing.assert_close(g, gw0[name], atol=1e-6, rtol=1e-6)
            assert g[1].abs().sum() == 0 and g[0].abs().sum() > 0  # expert 1 had no row


def test_grouped_kernel_under_bf16_autocast_returns_bf16_like_linear():
    """On a CPU it computes in fp32 (see HALF) and returns autocast's dtype: within bf16's rounding of the loop."""
    torch.manual_seed(0)
    x, counts = torch.randn(sum(COUNTS), 16), torch.tensor(COUNTS)
    out = {}
    for kernel in ("grouped", "loop", "auto"):
        torch.manual_seed(1)
        experts = Experts(len(COUNTS), 16, 24, "llama", kernel=kernel)  # bf16 rows of 32 and 48 bytes
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[kernel] = experts(x, counts)
    assert out["grouped"].dtype == out["loop"].dtype == torch.bfloat16
    torch.testing.assert_close(out["grouped"], out["loop"], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out["auto"], out["grouped"], atol=2e-2, rtol=2e-2)


def test_widths_the_grouped_gemm_refuses_fall_back():
    """bf16 rows of 8 and 12 elements (16 and 24 bytes): the grouped GEMM wants every row a multiple of 16 bytes.
    (On a CPU a bf16 model's grouped GEMM runs in fp32, whose rows are aligned: the refusal shows on another
    device, here the meta one told that it offers the grouped GEMM.)"""
    assert aligned((16, 24), torch.bfloat16) and aligned((8, 12), torch.float32)
    assert not aligned((8, 12), torch.bfloat16)
    experts = _experts("llama", "auto")  # widths (8, 12)
    experts.capability.known[("meta", torch.bfloat16)] = True
    rows = ExpertRows(torch.tensor(COUNTS), sum(COUNTS))
    x = torch.randn(sum(COUNTS), 8, dtype=torch.bfloat16)
    assert pick("auto", experts.capability, x.to("meta"), rows, experts.widths) != "grouped"
    assert pick("auto", experts.capability, x, rows, experts.widths) == "grouped"
    experts.to(torch.bfloat16)
    assert experts(x, torch.tensor(COUNTS)).shape == (len(x), 8)


def test_auto_picks_grouped_where_offered_else_padded_for_an_even_load_else_the_loop():
    x = torch.randn(400, 8)
    offered, refused = Capability(), Capability()
    refused.known[("cpu", torch.float32)] = False
    even, skewed = torch.tensor([100, 100, 100, 100]), torch.tensor([400, 0, 0, 0])
    w = (8, 12)
    assert pick("auto", offered, x, ExpertRows(even, 400), w) == "grouped"  # torch 2.13 offers it on this CPU
    assert pick("auto", offered, x.bfloat16(), ExpertRows(even, 400), (8, 12)) == "grouped"  # in fp32: see HALF
    assert pick("auto", offered, x.bfloat16(), ExpertRows(skewed, 400), (8, 12)) == "grouped"
    assert pick("auto", refused, x, ExpertRows(even, 400), w) == "padded"
    assert 4 * 400 - 400 > PAD_ROWS_PER_EXPERT * 4
    assert pick("auto", refused, x, ExpertRows(skewed, 400), w) == "loop"
    assert pick("loop", offered, x, ExpertRows(even, 400), w) == "loop"


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
@pytest.mark.parametrize("router", ["softmax", "sigmoid_bias"])
def test_a_training_forward_never_reads_a_value_on_the_host(flavor, router):
    """On the meta device every read of a value (``.item()``, ``.tolist()``, ``.cpu()``, a data-dependent shape)
    raises: forward, backward and the router statistics of a step run there, so on a GPU none of them waits
    for the device. (bf16: torch's shape function of the grouped GEMM accepts no other dtype.) The step's one
    read is :func:`pop_moe_totals`."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            moe = MoE(16, 32, flavor, 8, 2, aux_coeff=0.01, z_coeff=0.001, router=router)
            x = torch.randn(2, 5, 16, requires_grad=True)
    finally:
        torch.set_default_dtype(torch.float32)
    moe.experts.capability.known[("meta", torch.bfloat16)] = True
    for _ in range(2):  # two micro-batches' statistics added on the device
        y = moe(x)
        (y.sum() + moe.aux_loss).backward()
        moe.record()
    assert moe.stats.sums.device.type == "meta" and moe.stats.calls == 2
    assert all(p.grad is not None for p in moe.parameters())


def test_statistics_summed_on_the_device_reach_the_host_once_per_step():
    torch.manual_seed(0)
    moe = MoE(8, 16, "gpt2", 4, 2)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model = torch.nn.Sequential(moe)
    tokens = 0
    for n in (3, 5):
        moe(torch.randn(1, n, 8))
        moe.record()
        tokens += n
    totals = pop_moe_totals(model)
    kept, routed, prob_sum = totals.counts[0]
    assert kept.sum() == routed.sum() == 2 * tokens and prob_sum.sum().item() == pytest.approx(tokens)
    assert totals.tail[0] == tokens and totals.tail[5] == 2
    assert moe.stats.sums is None and pop_moe_totals(model).tail[5] == 0
