"""Parameter server (shardwise.ps): bsp equals synchronous data parallelism, ssp's bound holds, asp runs;
partitions cover the model; failures are reported with the rank, nothing hangs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.model import Transformer
from shardwise.ps.partition import partition_model
from tests.harness import run_on_ranks
from tests.test_train import assert_same_training, make_config

PS = {"ps.servers": 1}
STEPS = {"train.steps": 6, "train.eval_batches": 1}
"""Short runs: the equivalences hold from the first step; 6 steps cross warm-up and the cosine decay."""


def _train(cfg, run_dir: str, stop_after=None):
    import torch.distributed as dist

    from shardwise.worker import train

    result = train(cfg, Path(run_dir), collect_state=True, stop_after=stop_after)
    return (result.losses, result.state_dict, result.grad_norms) if dist.get_rank() == 0 else None


def run(tmp_path: Path, cache_dir: Path, name: str, nproc: int, stop_after=None, timeout=120, **overrides):
    run_dir = tmp_path / name
    cfg = make_config(run_dir, cache_dir, nproc, **{**STEPS, **overrides})
    return run_on_ranks(nproc, _train, cfg, str(run_dir), stop_after, timeout=timeout)[0]


def records(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ps" / f"worker{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ref")


@pytest.fixture(scope="module")
def one_process(ref_dir, cache_dir):
    return run(ref_dir, cache_dir, "dp1", 1)


@pytest.mark.parametrize("servers", [1, 2])
def test_bsp_equals_one_process(one_process, ref_dir, tmp_path, cache_dir, servers):
    """bsp with 2 workers and S servers trains the model one process trains with the same global batch;
    with two servers, pushes go by priority under a 16 KiB credit (the order does not change the sums), and the
    workers recompute their blocks' activations in backward (train.recompute full: the recomputed forward finds
    its partitions pulled; the pushes still start from the gradient hooks)."""
    sched = {"ps.scheduling": "priority", "ps.credit_kb": 16, "train.recompute": "full"} if servers == 2 else {}
    result = run(tmp_path, cache_dir, "bsp", 2 + servers, **{"ps.servers": servers, "ps.partition_kb": 8}, **sched)
    assert_same_training(result, one_process, atol=1e-5)
    rec = records(tmp_path / "bsp", 1)
    assert all(0 < r["ps_push_overlap_frac"] <= 1 for r in rec), "pushes start from gradient hooks in backward"
    assert all(r["ps_staleness"] == 0 for r in rec)
    ref_norm = {r["step"]: r["grad_norm"] for r in map(json.loads, (ref_dir / "dp1" / "metrics.jsonl").open())
                if "grad_norm" in r}
    for r in rec[1:]:  # the weights of step k hold clock k - 2's update: one process's step k - 1
        assert abs(r["ps_update_grad_norm"] - ref_norm[r["step"] - 1]) < 1e-4
    if servers == 2:
        assert all(r["ps_push_max_in_flight_bytes"] <= 16 * 1024 + 64 for r in rec)
        # priority pulls: every partition is waited for by the forward pre-hook of the module using it
        n_parts = len(partition_model(Transformer(make_config(tmp_path / "shape", cache_dir, 1).model), 8 * 1024, 2))
        assert all(r["ps_pull_lazy_waits"] == n_parts for r in rec)
        assert all(0.0 <= r["ps_pull_overlap_frac"] <= 1.0 for r in rec)


def test_bsp_trains_a_mixture_of_experts_as_one_process(tmp_path, cache_dir):
    """The tiny MoE GPT with the sigmoid_bias router: each worker's forward adds its micro-batch's router losses
    (one process accumulates the same micro-batches of 4), and in lock-step the workers add their loads and move
    their routers' balancing bias alike (a buffer the servers do not hold), as one process moves its own."""
    moe = {"model.preset": "tiny-moe", "model.moe_router": "sigmoid_bias", "model.moe_bias_rate": "0.01"}
    reference = run(tmp_path, cache_dir, "moe1", 1, **moe, **{"train.micro_batch": 4})
    result = run(tmp_path, cache_dir, "moe-bsp", 3, **PS, **moe)
    assert_same_training(result, reference, atol=1e-5)
    bias = [k for k in reference[1] if k.endswith("expert_bias")]
    assert bias and all(reference[1][k].abs().sum() > 0 and torch.equal(result[1][k], reference[1][k]) for k in bias)


def test_bsp_trains_bert_mlm_with_dropout_as_one_process(tmp_path, cache_dir):
    """Masked windows (train.objective mlm) and dropout 0.1: each worker's forward gets the key of its
    micro-batches' place in the global batch, so it draws the masks one process draws for them."""
    from tests.test_bert import BERT, DROPOUT

    reference = run(tmp_path, cache_dir, "bert1", 1, **BERT, **DROPOUT)
    assert_same_training(run(tmp_path, cache_dir, "bert-bsp", 3, **PS, **BERT, **DROPOUT), reference, atol=1e-5)


def test_ssp_with_zero_staleness_and_full_topk_equal_one_process(one_process, tmp_path, cache_dir):
    """ssp with s = 0 is bsp; top-k compression keeping every entry sends the exact gradient."""
    result = run(tmp_path, cache_dir, "ssp0", 3, **PS, **{"ps.consistency": "ssp", "comm.compression": "topk",
                                                             "comm.topk_ratio": 1.0})
    assert_same_training(result, one_process, atol=1e-5)


def test_asp_with_one_worker_equals_one_process(one_process, tmp_path, cache_dir):
    result = run(tmp_path, cache_dir, "asp1", 2, **PS, **{"ps.consistency": "asp"})
    assert_same_training(result, one_process, atol=1e-5)


def test_ssp_bound_holds_under_a_straggler(tmp_path, cache_dir):
    """No pull is staler than s, the fast worker reaches s, and the slow one is never ahead of its reads."""
    s = 2
    run(tmp_path, cache_dir, "ssp2", 3, **PS, **{"ps.consistency": "ssp", "ps.staleness": s, "ps.straggler": "1:400"})
    fast, slow = records(tmp_path / "ssp2", 0), records(tmp_path / "ssp2", 1)
    seen = [r["ps_staleness"] for r in fast + slow]
    assert max(seen) <= s, seen
    assert max(r["ps_staleness"] for r in fast) == s, "the fast worker should run s clocks ahead of the straggler"
    assert fast[-1]["ps_wait_s"] >= 0 and fast[-1]["ps_staleness_max"] == s
    server = json.loads((tmp_path / "ssp2" / "ps" / "server2.json").read_text())
    assert server["max_staleness_served"] <= s and server["updates"] == 6  # one update per complete clock


def test_ssp_under_a_straggler_trains_what_delayed_gradients_train(one_process, tmp_path, cache_dir):
    """ssp with s = 1 and a straggler slower than a fast step: the fast worker reads exactly one clock stale
    and the straggler fresh weights, so the run is the deterministic delayed-gradient computation of one
    process (shardwise.ps.delayed) -- the servers average stale gradients as Ho et al.'s SSP says, no more.
    The reference itself, with no delay, is the one-process run."""
    from shardwise.ps.delayed import train_delayed

    losses, state, _ = run(tmp_path, cache_dir, "ssp1", 3, **PS, **{"ps.consistency": "ssp", "ps.staleness": 1,
                                                                 "ps.straggler": "1:500"})
    fast = records(tmp_path / "ssp1", 0)
    assert [r["ps_staleness"] for r in fast[1:]] == [1] * (len(fast) - 1), "the fast worker should lag by s"
    cfg = make_config(tmp_path / "delayed", cache_dir, 2, **STEPS)  # the two workers' micro-batches
    fresh = train_delayed(cfg, tmp_path / "delayed", delays=[0, 0])
    assert_same_training((fresh.losses, fresh.state_dict), one_process, atol=1e-5)
    stale = train_delayed(cfg, tmp_path / "delayed", delays=[1, 0])
    assert_same_training((losses, state), (stale.losses, stale.state_dict), atol=1e-5)
    assert (stale.state_dict["tok_emb.weight"] - fresh.state_dict["tok_emb.weight"]).abs().max() > 1e-4, \
        "one clock of staleness should change the weights"


def test_asp_with_a_straggler_and_int8_pushes_trains(tmp_path, cache_dir):
    """asp: every push applied on arrival (2 workers x 6 clocks), no crash, loss falls; bytes counted."""
    losses, state, _ = run(tmp_path, cache_dir, "asp", 3, **PS, **{"ps.consistency": "asp", "ps.straggler": "1:300",
                                                                  "comm.compression": "int8"})
    assert all(torch.isfinite(v).all() for v in state.values())
    assert losses[-1] < losses[0]
    server = json.loads((tmp_path / "asp" / "ps" / "server2.json").read_text())
    assert server["updates"] == 12 and server["pushes_received"] > 0
    fast = records(tmp_path / "asp", 0)
    assert max(r["ps_staleness"] for r in fast) >= 1, "the fast worker should read weights lacking the straggler's"
    n_params = sum(v.numel() for k, v in state.items() if k != "lm_head.weight" and v.is_floating_point())
    pushed = fast[3]["ps_bytes_pushed"]
    assert n_params * 1.0 < pushed < n_params * 1.2, "int8 pushes carry about a byte per value"
    assert fast[3]["ps_bytes_pulled"] >= 4 * n_params * 0.9


# ---- partitions -------------------------------------------------------------------------------------


def test_a_100mb_tensor_makes_25_partitions_covering_it():
    from torch import nn

    from shardwise.ps.partition import check_cover

    with torch.device("meta"):
        model = nn.ModuleDict({"big": nn.Linear(5000, 5000, bias=False), "small": nn.Linear(10, 3)})
    parts = partition_model(model, 4_096_000, n_servers=2)
    big = [q for q in parts if q.name == "big.weight"]
    assert len(big) == 25 and sum(q.numel for q in big) == 25_000_000  # 100 MB of fp32 at BytePS's default
    check_cover(parts, {n: tuple(p.shape) for n, p in model.named_parameters()})
    servers = [q.server for q in parts]
    assert servers == sorted(servers) and set(servers) == {0, 1}, "contiguous key ranges, one per server"
    per_server = [sum(q.nbytes for q in parts if q.server == s) for s in (0, 1)]
    assert abs(per_server[0] - per_server[1]) <= 2 * 4_096_000  # balanced to within one partition
    with pytest.raises(ValueError, match="starts at 1024000, expected 0"):
        check_cover(parts[1:], {n: tuple(p.shape) for n, p in model.named_parameters()})


def test_priority_follows_the_forward_order_and_the_credit_bounds_bytes_in_flight():
    from shardwise.ps.scheduling import PushScheduler

    class Done:
        def wait(self, timeout=None):
            return True

    sent = []
    sched = PushScheduler("priority", credit_bytes=100, send=lambda item: sent.append(item) or [(Done(), 60, "")],
                          timeout_s=5)
    sched.flight.in_flight = 1000  # pretend the network is busy: everything queues
    for priority in (5, 3, 9, 0):
        sched.ready(priority, priority, 60, f"layer{priority}")
    assert sent == []
    sched.flight.in_flight = 0
    sched.flush()
    assert sent == ["layer0", "layer3", "layer5", "layer9"]
    assert sched.pop_metrics()["ps_push_max_in_flight_bytes"] <= 100
    sched.close()


def test_a_completed_send_starts_the_queued_pushes():
    """With the credit full, a ready push waits; when the send in flight completes, the freed credit starts
    it at once, from the completion -- not at the next gradient hook (ByteScheduler's credit release)."""
    import threading

    from shardwise.ps.scheduling import PushScheduler

    class Pending:
        def __init__(self):
            self.done = threading.Event()

        def wait(self, timeout=None):
            return self.done.wait(timeout.total_seconds())

    works, sent, second = [], [], threading.Event()

    def send(item):
        sent.append(item)
        if len(sent) == 2:
            second.set()
        works.append(Pending())
        return [(works[-1], 60, item)]

    sched = PushScheduler("priority", credit_bytes=100, send=send, timeout_s=30)
    sched.ready(1, 1, 60, "first")
    sched.ready(2, 2, 60, "second")  # 60 + 60 > 100: queued
    assert sent == ["first"]
    works[0].done.set()  # the first send completes: nothing else happens in this thread
    assert second.wait(30), "the queued push was not started when credit freed"
    assert sent == ["first", "second"]
    works[1].done.set()
    sched.flush()
    assert sched.pop_metrics()["ps_push_started_on_completion"] == 1
    sched.close()


@pytest.mark.parametrize("method", ["int8", "topk", "bf16"])
def test_push_compression_carries_what_it_drops_to_the_next_push(method):
    """With error feedback the decoded pushes sum to the gradients' sum minus only the last residual."""
    from shardwise.ps.protocol import PushCodec

    worker, server = PushCodec(method, ratio=0.1), PushCodec(method, ratio=0.1)
    g = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(20)]
    sent = torch.zeros(1000)
    for x in g:
        payload = worker.encode(7, x)
        assert payload.numel() * payload.element_size() < 4 * 1000 and payload.shape == server.payload(1000).shape
        sent += server.decode(payload, 1000)
    left = worker.residual.get(7, torch.zeros(1000))[:1000]
    tol = 1e-4 if method != "bf16" else 0.2  # a plain cast keeps no residual
    torch.testing.assert_close(sent + left, torch.stack(g).sum(0), atol=tol, rtol=0)


# ---- checkpoints and failures (the failure tests last: they replace the 3-rank pool) --------------


def test_checkpoints_resume_in_ps_mode_and_in_all_reduce_mode(one_process, tmp_path, cache_dir):
    """A bsp run stopped at step 3 resumes as bsp with two servers, and as all-reduce data parallelism,
    from the same checkpoint; both end where one uninterrupted process ends."""
    import shutil

    over = {**PS, "ckpt.every": 3}
    run(tmp_path, cache_dir, "ps", 3, stop_after=3, **over)
    shutil.copytree(tmp_path / "ps", tmp_path / "dp")
    losses, state, _ = run(tmp_path, cache_dir, "ps", 4, **{"ps.servers": 2, "ckpt.every": 3, "ckpt.resume": "true"})
    assert_same_training((losses, state), (one_process[0][3:], one_process[1]), atol=1e-5)
    losses, state, norms = run(tmp_path, cache_dir, "dp", 2, **{"ckpt.every": 3, "ckpt.resume": "true"})
    assert_same_training((losses, state, norms), (one_process[0][3:], one_process[1], one_process[2][3:]), atol=1e-5)


def _train_with_a_failure(cfg, run_dir: str, fail_rank: int, at_clock: int):
    """Train, with rank ``fail_rank`` raising when it reaches ``at_clock`` (a worker's step, a server's update)."""
    import torch.distributed as dist

    from shardwise.ps.server import Server
    from shardwise.ps.worker import Worker
    from shardwise.worker import train

    cls, name = (Server, "_step") if fail_rank >= cfg.parallel.dp else (Worker, "step")
    original = getattr(cls, name)

    def failing(self, *args, **kwargs):
        clock = args[1] if cls is Server else self.clock
        if clock == at_clock:
            raise RuntimeError(f"injected failure at clock {at_clock}")
        return original(self, *args, **kwargs)

    if dist.get_rank() == fail_rank:
        setattr(cls, name, failing)
    try:
        train(cfg, Path(run_dir))
    finally:
        setattr(cls, name, original)


@pytest.mark.parametrize("fail_rank", [1, 2], ids=["worker", "server"])
def test_a_failed_rank_is_named_and_nothing_hangs(tmp_path, cache_dir, fail_rank):
    """Worker rank 1 (or server rank 2) fails at clock 3: the others give up after parallel.timeout_s,
    naming the rank they waited for, instead of hanging."""
    cfg = make_config(tmp_path / "fail", cache_dir, 3, **STEPS, **PS, **{"parallel.timeout_s": 6})
    with pytest.raises(AssertionError) as e:
        run_on_ranks(3, _train_with_a_failure, cfg, str(tmp_path / "fail"), fail_rank, 3, timeout=60)
    text = str(e.value)
    assert "injected failure at clock 3" in text
    if fail_rank == 1:
        assert "ps server rank 2: a request from worker rank(s) [1] (clock 3 incomplete)" in text
        assert "ps worker rank 0: the other workers' losses of step 4: no answer within 6 s" in text
    else:
        for worker in (0, 1):
            assert (f"ps worker rank {worker}: the answer to the pull of clock 4 to/from server rank 2: "
                    "no answer within 6 s") in text
