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
from shardwise.parallel.context.blocks import attend, attend_backward, block_backward, block_forward, block_pair, merge
from shardwise.parallel.context.layout import SequenceLayout
from shardwise.train.metrics import read_metrics
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


@pytest.mark.parametrize("causal", [False, True])
def test_fused_block_kernel_equals_the_eager_reference(causal):
    """The ring's blocks run torch's fused CPU flash kernel: the same out / lse, and the same gradients from a
    merged (global) out and lse, as the eager FlashAttention §3.1 formulas (GQA folded back to kv heads)."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, h, 6, 8, generator=g) for h in (4, 2, 2, 4))
    out, lse = attend(q, k, v, 0.3, causal)
    ref_out, ref_lse = block_forward(q, k, v, 0.3, causal)
    torch.testing.assert_close((out, lse), (ref_out, ref_lse), atol=1e-5, rtol=0)
    merged_out, merged_lse = 0.5 * out, lse + 0.2  # what a merge with other blocks would have produced
    got = attend_backward(q, k, v, dout, merged_out, merged_lse, 0.3, causal)
    want = block_backward(q, k, v, dout, merged_lse, (dout * merged_out).sum(-1), 0.3, causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


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


def test_dp_cp_groups_hold_the_replicas_of_the_same_weights():
    """The joint group gradients and the loss are averaged over: ranks differing only in (dp, cp), cp fastest."""
    from shardwise.dist.mesh import ParallelDims

    dims = ParallelDims(pp=1, dp=2, cp=2, tp=2)  # rank = (dp * 2 + cp) * 2 + tp
    assert dims.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.size("dp_cp") == 4


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


STEPS = {"train.steps": 4}
LLAMA = {"model.preset": "tiny-llama"}


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache_dir):
    """One single-process run per flavour, computed when first asked for."""
    done = {}

    def get(flavour: str):
        if flavour not in done:
            extra = LLAMA if flavour == "llama" else {}
            done[flavour] = run(tmp_path_factory.mktemp(f"ref-{flavour}"), cache_dir, "one", 1, **STEPS, **extra)
        return done[flavour]

    return get


RING_NONE = {"parallel.cp_balance": "none"}


@pytest.mark.parametrize("name,flavour,nproc,overrides", [
    ("ring2", "gpt2", 2, {"parallel.cp": 2}),
    ("ring2-none-selective", "llama", 2, {"parallel.cp": 2, **RING_NONE, "train.recompute": "selective"}),
    ("allgather2", "llama", 2, {"parallel.cp": 2, "parallel.cp_algorithm": "allgather"}),
    ("ulysses2", "gpt2", 2, {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"}),
    ("ring4", "gpt2", 4, {"parallel.cp": 4}),
    ("ring4-none", "llama", 4, {"parallel.cp": 4, **RING_NONE}),
    ("ulysses4-gqa", "llama", 4, {"parallel.cp": 4, "parallel.cp_algorithm": "ulysses"}),
    ("cp2-dp2", "gpt2", 4, {"parallel.cp": 2}),
    ("cp2-tp2", "llama", 4, {"parallel.cp": 2, "parallel.tp": 2}),
    ("ulysses2-tp2-sp", "llama", 4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True,
                                     "parallel.cp_algorithm": "ulysses"}),
    ("cp2-pp2-full", "gpt2", 4, {"parallel.cp": 2, "parallel.pp": 2, "parallel.microbatches": 2,
                                 "train.recompute": "full"}),
    ("cp2-zero3", "gpt2", 2, {"parallel.cp": 2, "parallel.zero": 3}),
    # ZeRO++ hpZ: its groups are 2 consecutive ranks of the dp x cp group ZeRO shards over
    ("cp2-dp2-zero3-hpz2", "gpt2", 4, {"parallel.cp": 2, "parallel.zero": 3, "parallel.zero_hpz": 2}),
])
def test_context_parallel_equals_one_process(references, tmp_path, cache_dir, name, flavour, nproc, overrides):
    """Also: the attention work is balanced (head-tail) or 2cp - 1 (contiguous), and cp_sent_bytes measured
    where each send / collective is called equals plan --compare's prediction (shardwise.plan.context), as
    do, for the ring, the bytes its attention cores keep for backward."""
    from shardwise.config import Config
    from shardwise.plan.compare import measured_for_run, predicted_for_run

    extra = LLAMA if flavour == "llama" else {}
    result = run(tmp_path, cache_dir, name, nproc, **STEPS, **extra, **overrides)
    assert_same_training(result, references(flavour), atol=1e-5)
    cfg = Config.load(tmp_path / name / "config.toml")
    pred, meas = predicted_for_run(cfg), measured_for_run(tmp_path / name)
    assert meas["cp_sent_bytes"] == pred["cp_sent_bytes"]
    if cfg.parallel.tp == 1:  # (with tp the planner leaves out the padded vocabulary row's gradient: 256 B)
        assert meas["comm_bytes"] == pred["comm_bytes"]
    if cfg.parallel.cp_algorithm == "ring":
        assert meas["cp_attn_act_bytes"] == pred["cp_attn_act_bytes"]
    last = [r for r in read_metrics(tmp_path / name) if "loss" in r][-1]  # the last step's (a checkpoint's follows)
    assert "cp_attn_tiles" in last
    cp = overrides["parallel.cp"]
    assert last["cp_sent_bytes"] > 0
    if name == "ring2":  # 2 layers x 1 micro-batch, 2cp tiles each
        assert last["cp_attn_tiles"] == 2 * 2 * cp
    if overrides.get("parallel.cp_balance") == "none":  # contiguous causal: rank r does 4r + 2 tiles
        assert last["cp_attn_tile_imbalance"] == pytest.approx(2 * cp - 1)
    else:  # head-tail (and Ulysses, which attends every token on 1/cp of the heads): the same work everywhere
        assert last["cp_attn_tile_imbalance"] == pytest.approx(1.0)
    # the clock around the blocks: measured on every rank (its ratio is noise on a shared machine, not tested)
    assert 0 < last["cp_attn_s_min"] <= last["cp_attn_s"] <= last["cp_attn_s_max"]


def test_context_parallel_checkpoint_resumes_on_data_parallel(references, tmp_path, cache_dir):
    """Stop a ring cp 2 run after step 2 and resume it as dp 2: the checkpoint holds the single-process
    state (written once per dp x cp group), so the result equals an uninterrupted single process."""
    ckpt = {"ckpt.every": 2, **STEPS}
    run(tmp_path, cache_dir, "resumed", 2, stop_after=2, **ckpt, **{"parallel.cp": 2})
    result = run(tmp_path, cache_dir, "resumed", 2, **ckpt, **{"ckpt.resume": True})
    ref = references("gpt2")
    assert_same_training(([*ref[0][:2], *result[0]], result[1], [*ref[2][:2], *result[2]]), ref, atol=1e-5)
