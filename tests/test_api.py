"""The library API (shardwise.api) inside one's own script: the BERT example's loss falls on 2 ranks, our
data parallelism in it gives torch DDP's gradients, and a ZeRO-3 checkpoint resumes as data parallel."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_on_ranks


def _grads_vs_ddp(algorithm: str):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.bert_ddp import Encoder, MarkerDataset
    from shardwise import api

    ctx = api.init()
    torch.manual_seed(0)
    ours = api.data_parallel(Encoder(dropout=0.0), algorithm=algorithm)
    torch.manual_seed(0)
    peer = DDP(Encoder(dropout=0.0))
    loader = api.data_loader(MarkerDataset(64), 16, ctx)
    tokens, labels = next(iter(loader))
    for model in (ours, peer):
        F.cross_entropy(model(tokens), labels).backward()
    return max((a.grad - b.grad).abs().max().item()
               for a, b in zip(ours.module.parameters(), peer.module.parameters(), strict=True))


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_our_data_parallelism_in_the_example_equals_torch_ddp(algorithm):
    diffs = run_on_ranks(2, _grads_vs_ddp, algorithm)
    assert max(diffs) <= 1e-7, diffs


def _example(argv):
    from examples.bert_ddp import main

    return main(argv)


def test_example_trains_and_a_zero3_checkpoint_resumes_as_data_parallel(tmp_path):
    common = ["--samples", "128", "--batch-size", "16", "--dropout", "0", "--lr", "3e-3"]
    reference = run_on_ranks(2, _example, [*common, "--epochs", "4"])[0]
    assert reference[-1] < 0.7 * reference[0], f"the loss should fall: {reference}"
    ckpt = str(tmp_path / "ckpt")
    first = run_on_ranks(2, _example, [*common, "--epochs", "2", "--zero", "3", "--ckpt-dir", ckpt])[0]
    resumed = run_on_ranks(2, _example, [*common, "--epochs", "4", "--ckpt-dir", ckpt])[0]
    torch.testing.assert_close(torch.tensor(first + resumed), torch.tensor(reference), atol=1e-5, rtol=0)
