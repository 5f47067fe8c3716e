"""Every wait is bounded: a hung peer inside any sub-group of the mesh fails its partners within
``parallel.timeout_s``, and the error names the collective and the rank that did not answer.

torch gives a new process group a 30-minute timeout unless told otherwise, so the tp, cp, ep, pp x dp and
dp x cp groups must each be made with the run's timeout (``ParallelDims.build``). One 4-rank call of the
reusable worker pool runs every case: the hung rank stays out of the collective until its partners have
failed (a key on a store the test process hosts), so a group without the timeout does not hang the test
either: the hung rank gives up waiting, joins, and the collective succeeds -- which fails the test.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from shardwise.dist import diagnose

TIMEOUT_S = 1.0
CASES = [  # (layout, axis of the group the hung rank belongs to, hung rank)
    ({"tp": 2, "dp": 2}, "tp", 1),
    ({"cp": 2, "dp": 2}, "cp", 3),
    ({"dp": 4, "ep": 2}, "ep", 2),
    ({"pp": 2, "dp": 2}, "dp", 3),
    ({"cp": 2, "dp": 2}, "dp_cp", 0),
]


def _hang_in_each_group(port: int, cases, timeout_s: float) -> list:
    """Rank body: per case, build the mesh with ``timeout_s``; the hung rank skips an all-reduce over its
    ``axis`` group; its partners return the diagnosed line; the other ranks answer the roll call."""
    import torch.distributed as dist

    from shardwise.dist.diagnose import describe
    from shardwise.dist.mesh import ParallelDims

    me, world = dist.get_rank(), dist.get_world_size()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    out = []
    for i, (dims, axis, hung) in enumerate(cases):
        mesh = ParallelDims(**dims).build("cpu", timeout_s=timeout_s)
        case = dist.PrefixStore(f"case{i}", store)
        partners = [r for r in mesh.ranks(axis) if r != hung] if hung in mesh.ranks(axis) else []
        line = None
        if me == hung:  # hung: stays out until every partner has failed (or gives up after 20 timeouts)
            try:
                case.wait(["released"], timedelta(seconds=20 * timeout_s))
            except Exception:  # noqa: BLE001 - the partners never failed: join, so that they finish
                dist.all_reduce(torch.ones(4), group=mesh.group(axis))
        elif partners:
            try:
                dist.all_reduce(torch.ones(4), group=mesh.group(axis))
                line = "no error"
            except RuntimeError as e:
                line = describe(e, me, world, wait_s=0.5, store=case)
            if case.add("failed", 1) == len(partners):
                case.set("released", "1")
        else:
            case.set(str(me), "here")  # alive, outside the hung group: present at the roll call
        out.append(line)
        dist.barrier()
    return out


def test_a_hung_rank_in_any_sub_group_is_named_within_the_timeout():
    """tp, cp, ep, a pp x dp data-parallel group and the dp x cp group, on 4 ranks: every partner of the hung
    rank fails with "all_reduce failed on rank r: ranks not answering: [hung]" instead of waiting 30 minutes."""
    import torch.distributed as dist

    from tests.harness import run_on_ranks

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    per_rank = run_on_ranks(4, _hang_in_each_group, store.port, CASES, TIMEOUT_S)
    for i, (dims, axis, hung) in enumerate(CASES):
        from shardwise.dist.mesh import ParallelDims

        group = next(g for g in ParallelDims(**dims).groups(axis) if hung in g)
        for rank in (r for r in group if r != hung):
            line = per_rank[rank][i]
            assert line is not None and line.startswith(f"all_reduce failed on rank {rank}: ranks not answering: "
                                                        f"[{hung}]; backend: "), (axis, rank, line)
            assert "imed out" in line and "\n" not in line, line


def _raise_through(frames_dir: str, caller_file: str, message: str) -> BaseException:
    """An exception raised in ``all_reduce`` of a file under ``frames_dir`` (a stand-in for torch.distributed),
    called from ``caller`` of ``caller_file``: the frames a hung peer leaves on the stack."""
    collective = compile(f"def all_reduce():\n    raise RuntimeError({message!r})\n",
                         os.path.join(frames_dir, "distributed_c10d.py"), "exec")
    caller = compile("def caller(f):\n    f()\n", caller_file, "exec")
    scope: dict = {}
    exec(collective, scope)  # noqa: S102 - fixed source, compiled with chosen file names
    exec(caller, scope)  # noqa: S102
    try:
        scope["caller"](scope["all_reduce"])
    except RuntimeError as e:
        return e
    raise AssertionError("not raised")


@pytest.mark.parametrize(("message", "name"), [("Timed out waiting 1500ms", "all_reduce"),
                                               ("all_reduce/ring: timed out after 1.5 s", "all_reduce/ring")])
def test_our_frames_are_found_by_the_package_directory(tmp_path, monkeypatch, message, name):
    """Cloned into a directory named ``shardwise`` with a virtual environment inside it, torch's frames
    (``shardwise/.venv/.../torch/distributed``) and the tests' (``shardwise/tests``) hold ``/shardwise/`` in
    their paths but are not the package's: the line names the collective alone, as it does anywhere else;
    a caller inside the package is named relative to it."""
    clone = tmp_path / "shardwise"
    torch_dir = clone / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "distributed"
    torch_dir.mkdir(parents=True)
    monkeypatch.setattr(diagnose, "_TORCH_DIST_DIR", str(torch_dir))
    from_test = _raise_through(str(torch_dir), str(clone / "tests" / "test_failover.py"), message)
    assert diagnose.failed_collective(from_test) == name
    ours = os.path.join(diagnose._PACKAGE_DIR, "parallel", "data.py")
    from_package = _raise_through(str(torch_dir), ours, message)
    assert diagnose.failed_collective(from_package) == f"{name} (parallel/data.py:2 in caller)"
