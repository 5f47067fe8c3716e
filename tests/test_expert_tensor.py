"""Expert tensor parallelism (``parallel.etp``): every expert's MLP split over 2 tp ranks computes what the
single-device experts compute -- outputs, input gradients and each rank's slice of the weight gradients -- with
the tokens replicated over tp (Megatron's f / g around the experts) and with each rank holding its own tokens
(sequence parallelism: rows gathered over tp, partial outputs reduce-scattered back).
Training equivalence with one process is in tests/test_train_moe.py."""

from __future__ import annotations

import pytest

from tests.harness import run_on_ranks


def _split_experts_on_two_ranks(flavor: str, sequence_parallel: bool, counts: list[list[int]]):
    import torch
    import torch.distributed as dist

    from shardwise.model.moe import Experts
    from shardwise.parallel.expert.tensor import ExpertTensorParallel
    from shardwise.parallel.tensor.layers import install_grad_sync

    rank, group = dist.get_rank(), dist.group.WORLD
    torch.manual_seed(0)
    full = Experts(4, 8, 16, flavor)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.5)
    mine = counts[rank] if sequence_parallel else counts[0]
    xs = [torch.randn(sum(c), 8) for c in counts]  # each rank's tokens (the same on every rank)
    used = xs if sequence_parallel else xs[:1]
    ref = [full(x.requires_grad_(), c) for x, c in zip(used, counts, strict=False)]
    sum(r.pow(2).sum() for r in ref).backward()
    etp = ExpertTensorParallel(full, group, sequence_parallel=sequence_parallel)
    install_grad_sync(etp, group)  # the whole second bias's partial gradient under SP (the engine does it)
    x = (xs[rank] if sequence_parallel else xs[0]).detach().requires_grad_()
    y = etp(x, mine)
    y.pow(2).sum().backward()
    want = ref[rank] if sequence_parallel else ref[0]
    torch.testing.assert_close(y, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, used[rank if sequence_parallel else 0].grad, atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(etp.named_parameters(), full.named_parameters(), strict=True):
        info = p.tp_shard
        torch.testing.assert_close(p.grad, q.grad[info.full_index()], atol=1e-5, rtol=1e-5, msg=name)
        assert info.dim is not None or name == "fc_out.bias", name  # split, except the bias added after the sum


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated-tokens", "sp"])
def test_experts_split_over_tp_equal_one_device(flavor, sequence_parallel):
    """Also when one rank routed no token to some experts (and the ranks routed unequal numbers of rows)."""
    run_on_ranks(2, _split_experts_on_two_ranks, flavor, sequence_parallel, [[3, 1, 2, 2], [5, 0, 0, 1]])
