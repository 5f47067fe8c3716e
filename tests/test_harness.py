"""The multi-process harness itself: results per rank, failures and timeouts surface, pools recover."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import free_port, run_on_ranks


def _rank_and_sum(offset):
    x = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), x.item()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    return "fine"


def _block_forever():
    # Rank 0 waits for a message that no rank ever sends.
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    return dist.get_rank()


def _subgroup_sum():
    group = dist.new_group([0, 1])
    x = torch.ones(1)
    dist.all_reduce(x, group=group)
    return x.item()


def test_results_come_back_per_rank():
    out = run_on_ranks(2, _rank_and_sum, 10)
    assert out == [(0, 2, 21.0), (1, 2, 21.0)]


def test_exception_on_one_rank_surfaces_with_its_traceback():
    with pytest.raises(AssertionError) as info:
        run_on_ranks(2, _fail_on_rank_1)
    msg = str(info.value)
    assert "rank 1" in msg and "deliberate failure on rank one" in msg
    assert "Traceback" in msg and "_fail_on_rank_1" in msg
    assert run_on_ranks(2, _rank_and_sum, 0) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_timeout_raises_instead_of_hanging_and_pool_recovers():
    with pytest.raises(TimeoutError, match="_block_forever"):
        run_on_ranks(2, _block_forever, timeout=5)
    assert run_on_ranks(2, _rank_and_sum, 1) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_subgroups_and_other_world_sizes():
    assert run_on_ranks(1, _rank_and_sum, 5) == [(0, 1, 5.0)]
    assert run_on_ranks(2, _subgroup_sum) == [2.0, 2.0]


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
