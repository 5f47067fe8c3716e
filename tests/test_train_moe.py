"""Mixture of experts and expert parallelism in the trainer: the same model as one process.

The tiny MoE GPT (4 experts, top-2, every block) trains for a few steps on the global batch of
tests/test_train.py. The auxiliary losses are nonlinear in the set of tokens a router sees at once, so
the single-process reference accumulates the same micro-batches the data-parallel ranks hold
(``train.micro_batch`` = global batch / dp); losses and final weights (gathered from the expert
shards) agree within 1e-5 (fp32; all-to-all regrouping changes the order of additions).
"""

from __future__ import annotations

import pytest

from tests.test_train import assert_same_training, run

MOE = {"model.preset": "tiny-moe", "train.steps": 4}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """One process, accumulating micro-batches of 4 and of 2 (the shares of dp 2 and dp 4)."""
    tmp = tmp_path_factory.mktemp("ref-moe")
    return {dp: run(tmp, cache_dir, f"ref{dp}", 1, **MOE, **{"train.micro_batch": 8 // dp}) for dp in (2, 4)}


@pytest.mark.parametrize("name,nproc,overrides", [
    ("ep2", 2, {"parallel.ep": 2}),
    ("ep4", 4, {"parallel.ep": 4}),
    ("ep2-dp4", 4, {"parallel.ep": 2}),
    ("ep2-ours", 2, {"parallel.ep": 2, "comm.algorithm": "ring"}),
])
def test_expert_parallel_equals_one_process(reference, tmp_path, cache_dir, name, nproc, overrides):
    result = run(tmp_path, cache_dir, name, nproc, **MOE, **overrides)
    assert_same_training(result, reference[nproc], atol=1e-5)
