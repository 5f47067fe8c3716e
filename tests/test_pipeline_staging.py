"""Pipeline messages through host memory: stages sharing one GPU run on gloo, whose point-to-point takes
CPU tensors only, so a CUDA activation is sent from a CPU copy and received into a CPU buffer copied
onto the device when waited for (parallel/pipeline/transfer.py). Forced on here (CPU to CPU), the staged
path must give the single-process loss and gradients, the tied embedding's too, and the same
validation loss."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.pipeline import Pipeline, build_stage
from shardwise.parallel.pipeline.partition import partition
from tests.harness import run_on_ranks
from tests.test_pipeline import ATOL, RTOL, SEQ, _cfg, _reference


class _Cuda:
    device = torch.device("cuda", 0)


def _staged_pipeline() -> tuple[bool, bool, bool]:
    cfg, m, seed = _cfg(4), 2, 7
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2 * m, SEQ), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2 * m, SEQ), generator=gen)
    ref_loss, ref_grads = _reference(cfg, tokens, targets, seed)
    r = dist.get_rank()
    chunk = build_stage(cfg, r, 2, partition(cfg, 2, "even")[r], seed=seed)
    pipe = Pipeline([chunk], [0, 1], "1f1b", m, d_model=cfg.d_model)
    decided = (pipe.comm.staged(torch.ones(1)), pipe.comm.staged(_Cuda()))  # gloo: CPU no, CUDA yes
    pipe.comm.stage_through_host = True
    loss = pipe.step(tokens, targets)
    if loss is not None:
        torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=RTOL)
    for name, t in chunk.named_parameters():
        torch.testing.assert_close(t.grad, ref_grads[name], atol=ATOL, rtol=RTOL, msg=name)
    val = pipe.forward_only(tokens, targets)
    if val is not None:
        torch.testing.assert_close(val, ref_loss, atol=ATOL, rtol=RTOL)
    pipe.comm._backends = {"cpu": "gloo", "cuda": "nccl"}  # as under shardwise's NCCL default group
    pipe.comm.stage_through_host = None
    return decided == (False, True), getattr(chunk, "tied_weight", None) is not None, pipe.comm.staged(_Cuda())


def test_staged_pipeline_equals_one_process():
    for decided_right, tied, staged_on_nccl in run_on_ranks(2, _staged_pipeline):
        assert decided_right and tied and not staged_on_nccl
