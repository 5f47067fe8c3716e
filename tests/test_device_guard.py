"""The NCCL path's host-side exchanges, and the harness guard that catches a tensor on a device its
group's backend cannot take (``tests/device_guard.py``), on CPU.

On a GPU machine shardwise's default group is "cpu:gloo,cuda:nccl"; these tests declare the harness's
group that way (or NCCL-only) so that the guard checks what each call would hand to NCCL.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from shardwise.dist.devices import data_device, exchange_device, parse_backend_config, process_group_backend
from tests import device_guard
from tests.harness import run_on_ranks

NCCL_DEFAULT = "cpu:gloo,cuda:nccl"


def test_nccl_default_group_gets_gloo_beside_it():
    assert process_group_backend("nccl") == NCCL_DEFAULT
    assert process_group_backend("gloo") == "gloo"
    assert parse_backend_config(NCCL_DEFAULT) == {"cpu": "gloo", "cuda": "nccl"}


def _guard_catches() -> list[str]:
    assert device_guard.installed()
    caught = []
    with device_guard.declared_backend(None, "cuda:nccl"):  # as a plain "nccl" default group would be
        for name, call in [
            ("all_reduce", lambda: dist.all_reduce(torch.ones(2))),
            ("all_gather", lambda: dist.all_gather([torch.empty(2)] * dist.get_world_size(), torch.ones(2))),
            ("isend", lambda: dist.isend(torch.ones(1), (dist.get_rank() + 1) % dist.get_world_size())),
            ("all_gather_object", lambda: dist.all_gather_object([None] * dist.get_world_size(), "x")),
        ]:
            try:
                call()
            except device_guard.DeviceGuardError as e:
                caught.append(f"{name}: {e}")
    try:  # no declaration: gloo serves cpu and cuda, not meta
        dist.all_reduce(torch.ones(2, device="meta"))
    except device_guard.DeviceGuardError as e:
        caught.append(f"meta: {e}")
    dist.all_reduce(torch.ones(2))  # and the group still works
    return caught


def test_guard_fails_a_cpu_tensor_on_an_nccl_group():
    for caught in run_on_ranks(2, _guard_catches):
        assert [c.split(":")[0] for c in caught] == ["all_reduce", "all_gather", "isend", "all_gather_object",
                                                     "meta"]
        assert "a cpu tensor (2,) torch.float32 reached a group whose backend (cuda:nccl) serves only cuda" \
            in caught[0]


def _host_exchanges(declared: str) -> str:
    """Every host-side exchange the issue names, as it runs under ``declared``."""
    from shardwise.dist.comm import all_reduce, barrier
    from shardwise.dist.comm.compress import GradientAllReduce
    from shardwise.dist.comm.cost import calibrate
    from shardwise.dist.comm.p2p import verify_same
    from shardwise.train.state import gather_rng_states

    with device_guard.declared_backend(None, declared):
        assert exchange_device().type == "cpu" and data_device().type == "cpu"  # no CUDA here
        states = gather_rng_states()
        assert len(states) == dist.get_world_size() and all(s.device.type == "cpu" for s in states)
        verify_same(None, "all_reduce/ring", torch.ones(3), "sum")
        all_reduce(torch.ones(5), "sum", None, "ring")  # verify=True: the metadata check on the way
        barrier(None, "dissemination")  # its tokens
        calibrate(None, small=8, large=1 << 16, reps=1)  # _agree, its buffers, all_gather_object of hosts
        flat = torch.ones(64)
        for compression in ("topk", "int8"):
            GradientAllReduce("ring", compression, topk_ratio=0.25)(flat, None)
    return "ok"


def test_host_exchanges_are_legal_on_the_nccl_default_group():
    assert run_on_ranks(2, _host_exchanges, NCCL_DEFAULT) == ["ok", "ok"]


def test_without_gloo_beside_nccl_the_host_exchanges_would_fail():
    # what the issue reported: on an NCCL-only group the checkpoint's RNG gather cannot run on CPU;
    # exchange_device() sends it to the GPU instead, which this CPU machine has none of
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA|DeviceGuardError|CUDA"):
        run_on_ranks(2, _host_exchanges, "cuda:nccl")


def _subgroups_inherit() -> list[str]:
    from shardwise.dist import ParallelDims

    mesh = ParallelDims(dp=2, world_size=2).build()
    return [dist.get_backend_config(mesh.group(a)) for a in ("dp", "tp", "ep")] + [
        dist.get_backend_config(dist.new_group([0, 1]))]


def test_mesh_groups_inherit_the_default_groups_backends():
    # under nccl the default group's "cpu:gloo,cuda:nccl" is what every axis group gets; here gloo's
    for configs in run_on_ranks(2, _subgroups_inherit):
        assert configs == ["cpu:gloo,cuda:gloo"] * 4


class _CudaStandIn:
    """What the guard reads of a tensor, on a CUDA device this CPU machine does not have."""

    device, shape, dtype = torch.device("cuda", 0), torch.Size([4]), torch.float32


def _guard_on_cuda_tensors() -> list[str]:
    verdicts = []
    for name, config in [("all_reduce", None), ("broadcast", None), ("isend", None), ("batch_isend_irecv", None),
                         ("all_reduce", NCCL_DEFAULT), ("isend", NCCL_DEFAULT), ("all_reduce", "cpu:gloo")]:
        with contextlib.ExitStack() as stack:
            if config:
                stack.enter_context(device_guard.declared_backend(None, config))
            try:
                device_guard.check(name, [_CudaStandIn()], None)
                verdicts.append("ok")
            except device_guard.DeviceGuardError as e:
                verdicts.append(str(e))
    return verdicts


def test_guard_knows_what_gloo_and_nccl_take_on_cuda():
    """gloo serves CUDA all-reduce and broadcast but not point-to-point; nccl serves both; a group
    without a CUDA backend serves neither."""
    got = run_on_ranks(2, _guard_on_cuda_tensors)[0]  # the 2-rank pool the other tests use
    p2p = "a cuda tensor (4,) torch.float32 reached gloo's point-to-point (cpu:gloo,cuda:gloo), which takes CPU"
    assert got[:2] == ["ok", "ok"] and got[4:6] == ["ok", "ok"], got
    assert got[2].startswith("torch.distributed.isend: " + p2p), got[2]
    assert got[3].startswith("torch.distributed.batch_isend_irecv: " + p2p), got[3]
    assert "reached a group whose backend (cpu:gloo) serves only cpu tensors" in got[6], got[6]
