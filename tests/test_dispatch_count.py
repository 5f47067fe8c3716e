"""What a step costs a GPU's host, counted on the CPU (shardwise.dispatch_count), and the code it holds to account:

* the counter sees every kind of host synchronisation on device tensors (item, bool, tolist, .cpu(), an upload of
  host data, nonzero, boolean indexing, repeat_interleave without its size) and none on host tensors; collectives
  with their bytes;
* dropout off the CPU (whole-tensor Philox): the operators per site do not grow with the tensor (the CPU's chunked
  plan does), nothing is read back, the bits are the CPU plan's, and mask and attention trace into one graph;
* mixture of experts on ep 2: the exchanging dispatch reads the host once per MoE layer (forward and backward
  together), the padded one never; the padded slots are the dropping assignment's kept slots in order; the
  expert-major permutation built on the device is the loop's.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.dispatch_count import DispatchCounter
from shardwise.model.dropout import (
    CHUNK,
    AttentionDropout,
    Dropout,
    DropoutKey,
    MaskPlan,
    Span,
    keep_mask,
)
from shardwise.model.scores import attend as score_attend
from tests.harness import run_on_ranks

KEY = DropoutKey(seed=3, step=5, first_sequence=2)


def test_the_counter_sees_each_synchronisation_on_device_tensors_and_none_on_host_tensors():
    x = torch.arange(16.0)
    with DispatchCounter() as c:
        x.sum().item()
        bool(x[0] > 0)
        x.tolist()
        x.cpu()
        x[x > 3]
        x.nonzero()
        torch.tensor([1, 2], device=x.device)
        torch.repeat_interleave(torch.arange(2, device=x.device), x[:2].long() + 1)
        torch.repeat_interleave(torch.arange(2, device=x.device), x[:2].long() + 1, output_size=3)  # sized: free
        host = torch.arange(4)  # made on the host: reading it is free on any machine
        host.sum().item()
        host.tolist()
        x.cpu().tolist()  # the copy is the synchronisation; reading the copy is free
    assert c.counts.syncs_by_kind() == {"scalar": 2, "tolist": 1, "to_host": 2, "to_device": 1, "data_dependent": 3}
    sites = c.counts.syncs_by_site()  # no shardwise frame: the innermost outside torch, one per line
    assert len(sites) == 9 and all(site.startswith("test_dispatch_count.py:") for site in sites), sites
    assert c.counts.kernels > 0 and c.counts.ops >= c.counts.kernels and c.counts.wall_s >= c.counts.op_s > 0


def test_a_call_window_counts_one_cycle_of_a_loop_from_outside():
    """As bench_dispatch counts the trainer's step: from the second call of ``tick`` to the third."""
    from shardwise.dispatch_count import CallWindow

    class Loop:
        def tick(self, x):
            return x * 2

    original, x = Loop.tick, torch.ones(3)
    window = CallWindow(Loop, "tick", 1)
    loop = Loop()
    for i in range(3):
        y = loop.tick(x)
        y.sum().item() if i == 1 else y.tolist()
    counts = window.close()
    assert counts.syncs_by_kind() == {"scalar": 1} and dict(counts.by_op) == {
        "aten::mul": 1, "aten::sum": 1, "aten::_local_scalar_dense": 1}
    assert Loop.tick is original


# ---- dropout ------------------------------------------------------------------------------------------------


def _site_ops(build, device: str) -> tuple[int, int]:
    """(operators, host synchronisations) of one dropout site drawn by ``build()`` under a counter."""
    with DispatchCounter(device) as c:
        build()
    return c.counts.ops, c.counts.n_syncs


def _attention_site(b: int, h: int, t: int, device: str):
    drop = AttentionDropout(0.1, KEY, 1, Span.whole(h, device))
    pos = torch.arange(t, device=device)
    return lambda: drop.keep(b, pos, pos, t, causal=True, keys_aligned=t % 8 == 0)


def _residual_site(b: int, t: int, d: int, device: str):
    module = Dropout(0.1, "mlp_out", 1).train()
    x = torch.empty(b, t, d, device=device)
    return lambda: module(x, KEY)


def test_dropout_operators_do_not_grow_with_the_tensor_off_the_cpu():
    """On a device that is not a CPU (the meta device here: shapes without data) one pass over the whole tensor:
    the same operators at 8K elements and at B 8, H 32, T 4096 (4.3G), and no read of the device; the CPU's plan
    passes over chunks of CHUNK calls, so its count grows."""
    small = _site_ops(_attention_site(1, 2, 64, "meta"), "meta")
    larger = _site_ops(_attention_site(1, 4, 1024, "meta"), "meta")  # 4M elements: 64 passes of the CPU's plan
    assert small == larger and small[1] == 0 and small[0] < 250, (small, larger)
    assert _site_ops(_attention_site(8, 32, 4096, "meta"), "meta") == small
    assert _site_ops(_residual_site(1, 8, 64, "meta"), "meta") == _site_ops(_residual_site(8, 4096, 4096, "meta"),
                                                                            "meta")
    calls = 1 * 2 * 128 * 128 // 8  # a non-causal site of 2 * CHUNK / ... calls: the CPU plan takes several passes
    index = [torch.arange(1), torch.arange(2), torch.arange(128), torch.arange(128)]
    cpu = _site_ops(lambda: keep_mask(0.1, KEY, 1, "attn_probs", index, [2, 128, 128], aligned=True,
                                      plan=MaskPlan(calls // 4, True)), "cpu")
    whole = _site_ops(lambda: keep_mask(0.1, KEY, 1, "attn_probs", index, [2, 128, 128], aligned=True,
                                        plan=MaskPlan.for_device("cuda")), "cpu")
    assert cpu[0] > 3 * whole[0], (cpu, whole)


@pytest.mark.parametrize("causal,keys", [(True, range(16, 48)), (False, range(64)), (True, [5, 1, 40, 9, 10, 11])],
                         ids=["causal-aligned", "aligned", "unaligned"])
def test_the_whole_tensor_plan_draws_the_cpu_plans_bits(causal, keys):
    queries = torch.arange(8, 72, 3)
    index = [torch.arange(2, 5), torch.tensor([3, 0]), queries, torch.tensor(list(keys))]
    kw = {"causal": causal, "aligned": None}
    cpu = keep_mask(0.1, KEY, 2, "attn_probs", index, [4, 72, 72], plan=MaskPlan(16, True), **kw)  # 16 calls a pass
    whole = keep_mask(0.1, KEY, 2, "attn_probs", index, [4, 72, 72], plan=MaskPlan(None, False), **kw)
    assert torch.equal(cpu, whole) and cpu.any() and not cpu.all()
    assert MaskPlan.for_device("cpu") == MaskPlan(CHUNK, True)


def test_mask_and_attention_trace_into_one_graph_off_the_cpu():
    """Under torch.compile the whole-tensor plan and the eager attention core are one graph (TorchInductor fuses the
    generator into it on a GPU); the CPU's plan is drawn eagerly, outside."""
    q = torch.randn(2, 2, 32, 8)

    def attend(q):
        pos = torch.arange(32)
        keep = keep_mask(0.1, KEY, 1, "attn_probs", [torch.arange(2), torch.arange(2), pos, pos], [2, 32, 32], True,
                         aligned=True, plan=MaskPlan.for_device("cuda"))
        return score_attend(q, q, q, causal=True, keep=keep, p=0.1)

    torch.testing.assert_close(torch.compile(attend, backend="eager", fullgraph=True)(q), attend(q), rtol=0, atol=0)


# ---- mixture of experts ---------------------------------------------------------------------------------------


def _moe_step_syncs(dispatch: str) -> dict:
    """On each of 2 ranks: two MoE blocks (4 experts, top-2) under ep 2 with the given dispatch, one forward and
    backward counted after a warm-up."""
    import torch.distributed as dist

    from shardwise.model.moe import MoE
    from shardwise.parallel.expert.dispatch import apply_expert_parallel
    from shardwise.parallel.expert.padded import apply_padded_dispatch

    torch.manual_seed(0)
    factor = 1.0 if dispatch == "padded" else 0.0
    model = torch.nn.Sequential(*[MoE(32, 64, "gpt2", 4, 2, capacity_factor=factor, aux_coeff=0.01, layer_id=i)
                                  for i in range(2)])
    apply = apply_padded_dispatch if dispatch == "padded" else apply_expert_parallel
    apply(model, dist.group.WORLD, None, "native")
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    for counted in (False, True):
        counter = DispatchCounter().start() if counted else None
        y = model(x)
        (y.square().mean() + sum(m.aux_loss for m in model)).backward()
        if counter is not None:
            counter.stop()
    return {"syncs": counter.counts.syncs_by_site(), "collectives": sum(counter.counts.collectives.values()),
            "bytes": counter.counts.collective_bytes}


@pytest.mark.parametrize("dispatch,per_layer", [("exchange", 1), ("padded", 0)])
def test_expert_parallel_reads_the_host_at_most_once_per_moe_layer(dispatch, per_layer):
    for got in run_on_ranks(2, _moe_step_syncs, dispatch):
        syncs = got["syncs"]
        assert sum(n for kinds in syncs.values() for n in kinds.values()) == 2 * per_layer, syncs
        assert all(site.startswith("shardwise/parallel/expert/dispatch.py") for site in syncs), syncs
        assert got["collectives"] >= 2 * 4 and got["bytes"] > 0  # two all-to-alls each way per block


def test_padded_slots_are_the_kept_slots_in_order():
    from shardwise.model.moe import assign, capacity
    from shardwise.parallel.expert.padded import padded_slots

    g = torch.Generator().manual_seed(1)
    n, k, e = 24, 2, 4
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    experts[:10, 0] = 1  # expert 1 overflows its capacity
    gates = torch.rand(n, k, generator=g)
    with DispatchCounter() as c:
        padded = padded_slots(experts, gates, e, 1.0)
    assert c.counts.n_syncs == 0
    compact = assign(experts, gates, e, 1.0)
    cap = capacity(n, k, e, 1.0)
    rows = torch.cat([torch.arange(i * cap, i * cap + int(n_i)) for i, n_i in enumerate(compact.counts)])
    assert torch.equal(padded.counts, compact.counts) and torch.equal(padded.routed, compact.routed)
    assert torch.equal(padded.token[rows], compact.token) and torch.equal(padded.gate[rows], compact.gate)
    pads = torch.ones(e * cap, dtype=torch.bool).index_fill(0, rows, False)
    assert pads.any() and bool((padded.gate[pads] == 0).all()) and int(padded.dropped) == compact.dropped > 0


def test_expert_major_order_built_on_the_device_is_the_loops():
    from shardwise.parallel.expert.tensor import expert_major

    counts = torch.tensor([[2, 0, 3], [1, 4, 0]])
    starts = torch.tensor([0, 10])  # source 1's rows start at 10 (a padded layout)
    loop = [r for e in range(3) for i in range(2)
            for r in range(int(starts[i] + counts[i, :e].sum()), int(starts[i] + counts[i, :e + 1].sum()))]
    rows = int(counts.sum())
    with DispatchCounter() as c:
        got = expert_major(counts, starts, rows)
    assert got.tolist() == loop and c.counts.n_syncs == 0
