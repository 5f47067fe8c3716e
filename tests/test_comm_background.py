"""The communication thread: order, results, errors, and no thread left behind (no process group needed)."""

from __future__ import annotations

import threading

import pytest

from shardwise.dist.comm.background import CommThread


def _threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == name]


def test_calls_run_in_order_on_one_thread_and_the_thread_ends_at_join():
    runner = CommThread("test-comm")
    seen = []
    jobs = [runner.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i * i) for i in range(20)]
    assert runner.running
    assert runner.join() == jobs
    assert [i for i, _ in seen] == list(range(20)) and {n for _, n in seen} == {"test-comm"}
    assert [j.result for j in jobs] == [i * i for i in range(20)] and all(j.done for j in jobs)
    assert not runner.running and _threads("test-comm") == []
    assert runner.join() == []  # nothing submitted: nothing to wait for
    runner.submit(seen.clear)  # and it starts again for the next batch
    runner.join()
    assert seen == []


def test_a_failure_is_raised_at_join_naming_the_call_and_later_calls_are_skipped():
    runner = CommThread("test-comm")
    ran = []

    def boom():
        raise ValueError("all_reduce/ring: peer sent 11 elements, expected 10")

    runner.submit(ran.append, 1, label="bucket 0")
    runner.submit(boom, label="bucket 1")
    later = runner.submit(ran.append, 2, label="bucket 2")
    with pytest.raises(RuntimeError, match=r"bucket 1 failed .*ValueError: all_reduce/ring: peer sent 11") as e:
        runner.join()
    assert isinstance(e.value.__cause__, ValueError)
    assert ran == [1] and isinstance(later.error, RuntimeError)
    assert _threads("test-comm") == []
    runner.submit(ran.append, 3)  # the next batch runs normally
    runner.join()
    assert ran == [1, 3]


def test_abandon_skips_what_has_not_started():
    runner = CommThread("test-comm")
    gate, ran = threading.Event(), []
    runner.submit(gate.wait, 10)
    for i in range(5):
        runner.submit(ran.append, i)
    gate.set()
    runner.abandon()
    assert not runner.running and _threads("test-comm") == []
    assert len(ran) <= 5  # whatever had started finished; nothing runs after abandon returns
    before = list(ran)
    runner.submit(ran.append, "next")
    runner.join()
    assert ran == [*before, "next"]
