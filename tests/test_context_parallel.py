"""Context parallelism: blockwise attention merges exactly; ring / all-gather / Ulysses attention over cp
ranks train the same model as one process (tiny GPT-2 and Llama, fp32, losses and weights within 1e-5).

The trainer runs on N gloo ranks (tests/harness.py) against the single process of tests/test_train.py: the
same seed and global batch; each cp rank keeps its part (head-tail or contiguous) of every sequence."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import ConfigError
from shardwise.parallel.context.blocks import block_forward, block_pair, merge
from shardwise.parallel.context.layout import SequenceLayout
from tests.test_train import assert_same_training, make_config, run


def test_merging_blocks_in_any_order_equals_softmax_attention():
    """Liu et al. 2023 §3 / FlashAttention §3.1: the log-sum-exp merge of attention over disjoint key blocks,
    in any order, is softmax attention over all keys (GQA: 4 query heads over 2 kv heads)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 8, generator=g, dtype=torch.float64) for h, n in ((4, 5), (2, 12), (2, 12)))
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    blocks = [slice(0, 3), slice(3, 4), slice(4, 9), slice(9, 12)]
    for order in itertools.permutations(blocks):
        out = lse = None
        for s in order:
            out, lse = merge(out, lse, *block_forward(q, k[:, :, s], v[:, :, s], 8 ** -0.5, False))
        torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=0)
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 8 ** -0.5
        torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("balance", ["headtail", "none"])
def test_block_pairs_cover_the_causal_mask_once(balance):
    """Every (query, key) pair with key position <= query position is computed by exactly one block pair,
    and nothing else is; head-tail gives every rank the same work, a contiguous split 4r + 2 tiles."""
    cp, t = 4, 8
    layouts = [SequenceLayout(cp, r, balance) for r in range(cp)]
    work = []
    for r in range(cp):
        seen = torch.zeros(cp * t, cp * t, dtype=torch.int64)
        qpos = layouts[r].positions(t)
        w = 0.0
        for j in range(cp):
            pair = block_pair(r, j, t, balance)
            if pair is None:
                continue
            kpos = layouts[j].positions(t)
            qp, kp = qpos[pair.q], kpos[pair.kv]
            allowed = qp[:, None] >= kp[None, :]
            if pair.causal:
                allowed &= torch.ones(len(qp), len(kp), dtype=torch.bool).tril()
            else:
                assert allowed.all(), "an unmasked block must hold only visible pairs"
            seen[qp[:, None].expand_as(allowed)[allowed], kp[None, :].expand_as(allowed)[allowed]] += 1
            w += pair.work(t, t) / (t / 2) ** 2
        want = torch.zeros(cp * t, cp * t, dtype=torch.int64)
        want[qpos] = torch.ones(cp * t, cp * t, dtype=torch.int64).tril()[qpos]
        assert torch.equal(seen, want)
        work.append(w)
    assert work == ([2.0 * cp] * cp if balance == "headtail" else [4.0 * r + 2 for r in range(cp)])


def test_bad_context_parallel_layouts_are_refused_before_spawning(tmp_path, cache_dir):
    cases = [
        ({"parallel.cp": 2, "data.seq_len": 30}, "does not divide into 4 chunks"),
        ({"parallel.cp": 2, "parallel.cp_balance": "none", "data.seq_len": 31}, "does not divide into 2 chunks"),
        ({"parallel.cp": 2, "parallel.cp_algorithm": "ulysses", "model.n_heads": 3, "model.d_model": 48},
         "splits the 3 heads"),
        ({"parallel.cp": 2, "parallel.cp_algorithm": "tree"}, "parallel.cp_algorithm='tree' is not valid"),
        ({"parallel.cp_balance": "none"}, "but parallel.cp=1"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            make_config(tmp_path, cache_dir, 2, **overrides)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, cache_dir):
    return run(tmp_path_factory.mktemp("ref-cp"), cache_dir, "dp1", 1, **{"train.steps": 4})


@pytest.mark.parametrize("name,nproc,overrides", [
    ("ring2", 2, {"parallel.cp": 2}),
])
def test_context_parallel_equals_one_process(single_process, tmp_path, cache_dir, name, nproc, overrides):
    result = run(tmp_path, cache_dir, name, nproc, **{"train.steps": 4, **overrides})
    assert_same_training(result, single_process, atol=1e-5)
