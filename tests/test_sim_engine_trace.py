"""The simulator costs the engine's own parallel pieces (shardwise.sim.engine_trace on shardwise.sim.mirror).

Each layout's pieces are traced as parallelize() rewrites them, on one process: the operators tensor / sequence
parallelism, ring attention and the experts' dispatch add must be in the traces (the simulator once traced the
plain block and missed them), the collectives must not (the communication model costs them), and the mirror
process group must be gone afterwards.
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

from shardwise.plan.hardware import GPU
from shardwise.sim.compute import FUSED_ATTENTION
from shardwise.sim.costs import RankCosts
from shardwise.sim.engine_trace import engine_traces
from shardwise.sim.hardware import SimHardware
from shardwise.sim.simulate import load_config

TINY = {"model.preset": "tiny", "model.vocab_size": "512", "data.seq_len": "32", "train.precision": "fp32",
        "train.global_batch": "4"}


def _cfg(gpus: int, **overrides):
    gpu = GPU("test", {"fp32": 1e12}, 80e9, intra_bw=1e9, inter_bw=1e9, intra_latency=1e-5, inter_latency=1e-5)
    hw = SimHardware(gpu=gpu, nodes=1, gpus_per_node=gpus, hbm_bw=1e12, backend="gloo")
    return load_config(None, {**TINY, **overrides}, hw), hw


def _ops(tr) -> Counter:
    return Counter(op.name for op in tr.fwd + tr.bwd)


def _flops(tr) -> float:
    return sum(op.flops for op in tr.fwd + tr.bwd)


def test_tensor_and_sequence_parallel_pieces_carry_their_own_operators():
    plain_cfg, _ = _cfg(1)
    sp_cfg, _ = _cfg(2, **{"parallel.tp": "2", "parallel.sequence_parallel": "true"})
    batch = plain_cfg.train.micro_batch
    assert sp_cfg.train.micro_batch == batch
    plain, sp = engine_traces(plain_cfg, batch, "meta"), engine_traces(sp_cfg, batch, "meta")
    # half of every matrix product on a tp rank: the FLOPs of the plain block's share ...
    assert _flops(sp["mlp"]) == 0.5 * _flops(plain["mlp"])
    # ... but more operators: the region's gather / reduce-scatter buffers and copies, the row-parallel bias add
    extra = sum((_ops(sp["block"]) - _ops(plain["block"])).values())
    assert extra >= 8, _ops(sp["block"]) - _ops(plain["block"])
    assert "repeat" not in _ops(sp["block"])  # the mirror group's stand-in for the all-gather is not an operator
    # the vocabulary-parallel loss: max, exp-sum and target-logit pieces instead of one log-softmax
    assert "_log_softmax" in _ops(plain["head"]) and "_log_softmax" not in _ops(sp["head"])
    assert sum(_ops(sp["head"]).values()) >= 3 * sum(_ops(plain["head"]).values())
    assert not dist.is_initialized()


def test_ring_attention_traces_its_block_pairs_and_merges():
    cfg, _ = _cfg(2, **{"parallel.cp": "2"})
    core = engine_traces(cfg, cfg.train.micro_batch, "cpu")["core"]
    fwd = Counter(op.name for op in core.fwd)
    assert fwd["_scaled_dot_product_flash_attention_for_cpu"] == 2  # the diagonal pair and the one from rank 1
    assert sum(op.name in FUSED_ATTENTION for op in core.bwd) == 2
    assert len(core.fwd) > 10  # the log-sum-exp merge of the two partial results
    plain, _ = _cfg(1)
    assert len(engine_traces(plain, cfg.train.micro_batch, "cpu")["core"].fwd) == 1


def test_expert_dispatch_is_traced_and_no_collective_is():
    cfg, hw = _cfg(2, **{"model.n_experts": "4", "parallel.ep": "2"})
    traces = engine_traces(cfg, cfg.train.micro_batch, "meta")
    moe = _ops(traces["moe"])
    # the splits reach the host in one copy
    assert moe["index_select"] >= 2 and moe["sort"] >= 1 and moe["_to_copy"] >= 1, moe
    assert all(not name.startswith(("allreduce", "alltoall", "send", "recv", "_allgather")) for name in moe)
    # the traced block, not the estimate, is what the step is costed with
    costs = RankCosts(cfg, hw)
    layer = next(i for i in range(cfg.model.n_layers) if i % cfg.model.moe_every == cfg.model.moe_every - 1)
    assert costs.block(layer).fwd.seconds == costs.roofline.block_cost(traces["moe"]).fwd.seconds
    assert not dist.is_initialized()
