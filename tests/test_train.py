"""End-to-end training: every layout trains the same model as one process; resume is bit-exact.

The trainer runs inside the reusable gloo worker pool (tests/harness.py); the corpus is a
slice of the standard library tokenized once per session into a temporary cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.config import Config
from shardwise.launch import prepare_run
from shardwise.train.checkpoint import list_checkpoints
from tests.harness import run_on_ranks


def make_config(run_dir: Path, cache_dir: Path, nproc: int, **overrides) -> Config:
    base = {
        "model.preset": "tiny",
        "data.source": "stdlib",
        "data.max_bytes": "400000",
        "data.seq_len": "32",
        "data.cache_dir": str(cache_dir),
        "train.steps": "10",
        "train.global_batch": "8",
        "train.warmup_steps": "2",
        # Adam's epsilon above the floating-point noise floor: a gradient that is zero in exact arithmetic
        # (GPT-2's key bias: softmax ignores a shift shared by all keys) is reduction-order noise of ~1e-10,
        # which eps 1e-8 turns into lr-sized steps that differ between layouts; eps 1e-6 leaves real
        # gradients (>= 1e-5 here) to Adam as before
        "train.eps": "1e-6",
        "train.precision": "fp32",
        "train.eval_every": "0",
        "train.eval_batches": "2",
        # a fixed peak for the MFU column: no run measures the CPU's matmul peak (seven 1024^3 products per rank)
        "train.peak_flops": "1e12",
        "parallel.nproc": str(nproc),
        "ckpt.every": "0",
        "run.dir": str(run_dir),
        "run.progress": "false",
        "run.tensorboard": "false",
    }
    base.update({k: str(v) for k, v in overrides.items()})
    cfg, _ = prepare_run(Config.load(overrides=base))
    return cfg


def _train_on_rank(cfg: Config, run_dir: str, stop_after=None):
    import torch.distributed as dist

    from shardwise.train.loop import train

    result = train(cfg, Path(run_dir), collect_state=True, stop_after=stop_after)
    return (result.losses, result.state_dict, result.grad_norms) if dist.get_rank() == 0 else None


def run(tmp_path: Path, cache_dir: Path, name: str, nproc: int, stop_after=None, **overrides):
    run_dir = tmp_path / name
    cfg = make_config(run_dir, cache_dir, nproc, **overrides)
    return run_on_ranks(nproc, _train_on_rank, cfg, str(run_dir), stop_after)[0]


def assert_same_training(a, b, atol: float, norm_rtol: float = 1e-5):
    """The same training: per-step losses and final weights within ``atol``, and the pre-clip global gradient
    norm of every step within ``norm_rtol`` relative -- what clipping hides (a gradient scaled by a constant
    is clipped back to the same update) and Adam hides (it is invariant to the gradient's scale) the norm
    still shows. ``a``, ``b``: ``(losses, state, grad_norms)`` as :func:`run` returns them; the norms are
    compared wherever both runs measured one (the parameter server's workers each measure only their own, and
    pass ``(losses, state)`` or empty norms)."""
    (losses_a, state_a, norms_a), (losses_b, state_b, norms_b) = ((*r[:2], r[2] if len(r) > 2 else []) for r in (a, b))
    assert len(losses_a) == len(losses_b)
    torch.testing.assert_close(torch.tensor(losses_a), torch.tensor(losses_b), atol=atol, rtol=0)
    if norms_a and norms_b:
        assert len(norms_a) == len(norms_b) == len(losses_a)
        torch.testing.assert_close(torch.tensor(norms_a, dtype=torch.float64),
                                   torch.tensor(norms_b, dtype=torch.float64), rtol=norm_rtol, atol=0,
                                   msg=lambda m: f"pre-clip gradient norms: {m}")
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        torch.testing.assert_close(state_a[key], state_b[key], atol=atol, rtol=0, msg=key)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, cache_dir):
    return run(tmp_path_factory.mktemp("ref"), cache_dir, "dp1", 1)


@pytest.mark.parametrize("nproc", [2, 4])
def test_data_parallel_equals_one_process(single_process, tmp_path, cache_dir, nproc):
    result = run(tmp_path, cache_dir, f"dp{nproc}", nproc)
    assert result[0][-1] < result[0][0], "the loss should fall over 10 steps"
    assert_same_training(result, single_process, atol=1e-5)


def test_gradient_accumulation_equals_the_large_batch(single_process, tmp_path, cache_dir):
    # global batch 8 on 2 ranks as micro-batches of 2 with 2 accumulation steps (no_sync for the first).
    result = run(tmp_path, cache_dir, "accum", 2, **{"train.micro_batch": 2})
    assert_same_training(result, single_process, atol=1e-5)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_nothing(single_process, tmp_path, cache_dir, mode):
    result = run(tmp_path, cache_dir, f"recompute-{mode}", 1, **{"train.recompute": mode})
    assert_same_training(result, single_process, atol=1e-6)


def test_llama_flavour_data_parallel(tmp_path, cache_dir):
    ref = run(tmp_path, cache_dir, "llama1", 1, **{"model.preset": "tiny-llama", "train.steps": 6})
    dp = run(tmp_path, cache_dir, "llama2", 2, **{"model.preset": "tiny-llama", "train.steps": 6})
    assert_same_training(dp, ref, atol=1e-5)


def test_bf16_trains(tmp_path, cache_dir):
    losses, _, _ = run(tmp_path, cache_dir, "bf16", 2, **{"train.precision": "bf16"})
    assert losses[-1] < losses[0] - 0.1


def test_fp16_with_loss_scaling_trains(tmp_path, cache_dir):
    losses, _, _ = run(tmp_path, cache_dir, "fp16", 2, **{"train.precision": "fp16"})
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1


def test_stop_and_resume_is_bit_identical(single_process, tmp_path, cache_dir):
    overrides = {"ckpt.every": 3, "ckpt.keep": 5}
    uninterrupted = run(tmp_path, cache_dir, "full", 2, **overrides)
    run(tmp_path, cache_dir, "resumed", 2, stop_after=6, **overrides)
    saved = [p.name for p in list_checkpoints(tmp_path / "resumed" / "checkpoints")]
    assert saved == ["step_00000003", "step_00000006"]
    resumed = run(tmp_path, cache_dir, "resumed", 2, **overrides, **{"ckpt.resume": "true"})
    assert resumed[0] == uninterrupted[0][6:]
    for key, value in uninterrupted[1].items():
        assert torch.equal(value, resumed[1][key]), key


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, cache_dir):
    overrides = {"ckpt.every": 2, "ckpt.keep": 3}
    uninterrupted = run(tmp_path, cache_dir, "full", 1, **overrides)
    run(tmp_path, cache_dir, "broken", 1, stop_after=6, **overrides)
    newest = tmp_path / "broken" / "checkpoints" / "step_00000006" / "shard-00000.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    resumed = run(tmp_path, cache_dir, "broken", 1, **overrides, **{"ckpt.resume": "true"})
    assert len(resumed[0]) == 6, "resumed from step 4, the newest valid checkpoint"
    for key, value in uninterrupted[1].items():
        assert torch.equal(value, resumed[1][key]), key
