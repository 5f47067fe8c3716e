"""ZeRO's direct-exchange reduce-scatter and all-gather (:mod:`shardwise.parallel.zero.exchange`) on 2 and 4
gloo ranks: exactly (atol = 0) the rank-order sum of every rank's block, in place or not, with several
exchanges in flight at once; the all-gather equals the backend's."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_on_ranks


def _exchanges():
    import torch.distributed as dist

    from shardwise.parallel.zero import exchange

    world, rank = dist.get_world_size(), dist.get_rank()
    n = 1003  # per-rank block; odd, so blocks are not aligned to anything
    inputs = [torch.randn(world * n, generator=torch.Generator().manual_seed(10 * i + rank)) for i in range(3)]
    everyone = []
    for x in inputs:  # every rank's input, to fold by hand
        full = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(full, x)
        everyone.append(full.view(world, -1))
    expected = []
    for all_x in everyone:
        acc = all_x[0, rank * n:(rank + 1) * n].clone()
        for j in range(1, world):
            acc += all_x[j, rank * n:(rank + 1) * n]
        expected.append(acc)
    outs = [torch.empty(n), None, torch.empty(n)]
    flats = [x.clone() for x in inputs]
    outs[1] = flats[1][rank * n:(rank + 1) * n]  # in place: the own block of the input
    pending = [exchange.reduce_scatter(o, f, None, tag=exchange.TAG + 2 * i)
               for i, (o, f) in enumerate(zip(outs, flats, strict=True))]
    for p in reversed(pending):  # all three in flight; finish in any order
        p.wait()
    reduced = [torch.equal(o, e) for o, e in zip(outs, expected, strict=True)]

    shard = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    native = torch.empty(world * n)
    dist.all_gather_into_tensor(native, shard)
    ours = torch.zeros(world * n)
    copied = exchange.all_gather(ours, None, shard, tag=exchange.TAG + 1)
    in_place = torch.zeros(world * n)
    in_place[rank * n:(rank + 1) * n] = shard
    inplace = exchange.all_gather(in_place, None, tag=exchange.TAG + 3)
    copied.wait()
    inplace.wait()
    return reduced, torch.equal(ours, native), torch.equal(in_place, native), exchange.use_exchange(None, shard)


@pytest.mark.parametrize("world", [2, 4])
def test_direct_exchange_is_exact(world):
    for rank, (reduced, gathered, gathered_in_place, used) in enumerate(run_on_ranks(world, _exchanges)):
        assert reduced == [True, True, True], rank
        assert gathered and gathered_in_place, rank
        assert used, rank
