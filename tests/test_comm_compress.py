"""Gradient all-reduce through DataParallel: every algorithm trains exactly like native, and
every compression converges while sending fewer bytes."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from shardwise.dist.comm.compress import dequantize_int8, quantize_int8
from tests.harness import run_on_ranks
from tests.test_train import make_config


def test_int8_quantization_error_is_half_a_step():
    x = torch.randn(4 * 256) * torch.logspace(-3, 1, 4).repeat_interleave(256)
    q, scale = quantize_int8(x, 256)
    err = (dequantize_int8(q, scale, 256) - x).abs().view(4, 256).amax(dim=1)
    assert torch.all(err <= scale / 2 + 1e-7)
    assert q.dtype == torch.int8


def _compressed_sums(world: int) -> dict:
    """Each compression on a known vector: closeness to the exact sum, bytes sent, and (over
    several steps) conservation of mass by error feedback."""
    import torch.distributed as dist

    from shardwise.dist.comm.compress import GradientAllReduce

    rank = dist.get_rank()
    n = 5000
    out = {}
    for algorithm in ("native", "ring"):
        for comp, kwargs in [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("topk", {"topk_ratio": 0.05}),
                             ("topk", {"topk_ratio": 1.0})]:
            fn = GradientAllReduce(algorithm, comp, **kwargs)
            steps, total_in, total_out = 5, torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
            first = None
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + rank)
                x = torch.randn(n, generator=g)
                exact = x.clone()
                dist.all_reduce(exact)
                buf = x.clone()
                work = fn(buf, None)
                if work is not None:
                    work.wait()
                total_in += exact.double()
                total_out += buf.double()
                if first is None:
                    first = ((buf - exact).abs().max().item() / exact.abs().max().item(), buf.clone())
            key = f"{algorithm}/{comp}{kwargs.get('topk_ratio', '')}"
            # what error feedback still holds back, relative to the mass sent over all steps
            lag = ((total_in - total_out).abs().max() / total_in.abs().max()).item()
            stats = fn.pop_stats()  # ours: bytes on the wire, counted per send; native: bytes handed to it
            moved = stats.bytes_sent if algorithm != "native" else stats.handed
            assert (stats.backend_handed > 0) == (algorithm == "native") and stats.handed > 0
            if (algorithm, comp) == ("native", "none"):  # every call counted, the shortcut after the first too
                assert stats.calls == steps and stats.backend_handed == steps * n * 4
            out[key] = {"rel_err": first[0], "bytes": moved / steps, "lag": lag,
                        "crc": zlib.crc32(first[1].numpy().tobytes())}
    return out


@pytest.mark.parametrize("world", [3])
def test_compressed_all_reduce(world):
    results = run_on_ranks(world, _compressed_sums, world, timeout=300)
    r0 = results[0]
    for other in results[1:]:
        assert {k: v["crc"] for k, v in other.items()} == {k: v["crc"] for k, v in r0.items()}, \
            "every rank must end with the same gradient"
    for alg in ("native", "ring"):
        dense = r0[f"{alg}/none"]["bytes"]
        assert r0[f"{alg}/none"]["rel_err"] < 1e-6
        assert r0[f"{alg}/fp16"]["rel_err"] < 2e-3 and r0[f"{alg}/bf16"]["rel_err"] < 2e-2
        assert r0[f"{alg}/int8"]["rel_err"] < 2e-2
        assert r0[f"{alg}/topk1.0"]["rel_err"] < 1e-6
        # on the wire (ring) the dense all-reduce sends 2(N-1)/N of the vector, the compressed ones (N-1)/N
        # of their all-to-all and all-gather; handed (native) the dense vector once, the compressed the
        # all-to-all input plus the all-gathered output (about 2x the int8 bytes, N x the top-k packet)
        bounds = {"ring": [("fp16", 0.51), ("bf16", 0.51), ("int8", 0.30), ("topk0.05", 0.16)],
                  "native": [("fp16", 0.51), ("bf16", 0.51), ("int8", 0.56), ("topk0.05", 0.31)]}[alg]
        for comp, most in bounds:
            assert r0[f"{alg}/{comp}"]["bytes"] <= most * dense, (alg, comp, r0[f"{alg}/{comp}"]["bytes"], dense)
        # error feedback: what was dropped is carried, not lost -- the shortfall stays bounded
        assert r0[f"{alg}/int8"]["lag"] < 0.03
        assert r0[f"{alg}/topk0.05"]["lag"] < 2.0


# ---- training ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache-comm")


def _train_several(cfgs: list, run_dirs: list[str]):
    import torch.distributed as dist

    from shardwise.train.loop import train

    results = []
    for cfg, run_dir in zip(cfgs, run_dirs, strict=True):
        result = train(cfg, Path(run_dir), collect_state=True)
        metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        sent = [m["comm_bytes"] for m in metrics if "loss" in m]  # handed to collectives (native: no wire count)
        results.append((result.losses, result.state_dict, sent))
    return results if dist.get_rank() == 0 else None


def _train(tmp_path: Path, cache_dir: Path, variants: dict[str, dict], steps: int) -> dict:
    names = list(variants)
    cfgs = [make_config(tmp_path / n, cache_dir, 2, **{"train.steps": steps, **variants[n]}) for n in names]
    out = run_on_ranks(2, _train_several, cfgs, [str(tmp_path / n) for n in names], timeout=600)[0]
    return dict(zip(names, out, strict=True))


def test_every_algorithm_trains_like_native(tmp_path, cache_dir):
    variants = {a: {"comm.algorithm": a} for a in ("native", "ring", "rabenseifner", "recursive_doubling", "tree",
                                                    "naive", "star", "hierarchical", "torus", "auto")}
    runs = _train(tmp_path, cache_dir, variants, steps=4)
    ref_losses, ref_state, _ = runs["native"]
    for name, (losses, state, sent) in runs.items():
        # two ranks: every algorithm adds the same two numbers once, so training is bit-identical
        assert losses == ref_losses, name
        for key in ref_state:
            assert torch.equal(state[key], ref_state[key]), (name, key)
        assert all(s > 0 for s in sent), name


MARGIN = 0.15
"""Final loss (mean of the last 3 steps) within this of uncompressed training's, after 12 steps."""


def test_every_compression_converges_with_fewer_bytes(tmp_path, cache_dir):
    variants = {"none": {}, "fp16": {"comm.compression": "fp16"}, "bf16": {"comm.compression": "bf16"},
                "int8": {"comm.compression": "int8"},
                "topk": {"comm.compression": "topk", "comm.topk_ratio": 0.2}}
    runs = _train(tmp_path, cache_dir, variants, steps=12)
    ref_losses, _, ref_sent = runs["none"]
    ref_final = sum(ref_losses[-3:]) / 3
    assert ref_final < ref_losses[0] - 0.1
    for name, (losses, _, sent) in runs.items():
        final = sum(losses[-3:]) / 3
        print(f"{name}: final loss {final:.4f} vs {ref_final:.4f}, bytes {sent[-1]:.0f} vs {ref_sent[-1]:.0f}")
        assert abs(final - ref_final) < MARGIN, (name, final, ref_final)
        if name != "none":
            assert sent[-1] < ref_sent[-1], (name, sent[-1], ref_sent[-1])


# ---- top-k at 1 % (the benchmark's setting) on 4 ranks ------------------------------------------


def _train_four_ranks(tmp_path: Path, cache_dir: Path, variants: dict[str, dict], steps: int) -> dict:
    names = list(variants)
    cfgs = [make_config(tmp_path / n, cache_dir, 4, **{"train.steps": steps, "train.warmup_steps": 5,
                                                        **variants[n]}) for n in names]
    out = run_on_ranks(4, _train_several, cfgs, [str(tmp_path / n) for n in names], timeout=600)[0]
    return dict(zip(names, out, strict=True))


TOPK_1PCT_MARGIN = 0.25
"""The trainer (AdamW, tiny GPT, 4 ranks, 40 steps): final loss (mean of the last 3 steps) of top-k
at 1 % within this of uncompressed training's. Measured: 3.186 vs 3.115 (+0.07); a compressor that
delivers zeros ends at 5.374 (+2.26). AdamW rescales whatever arrives, so dropping top-k's error
feedback barely shows here (3.191, +0.08): the next test holds that with SGD."""


def test_topk_one_percent_trains_on_four_ranks(tmp_path, cache_dir):
    runs = _train_four_ranks(tmp_path, cache_dir, {"none": {}, "topk": {"comm.compression": "topk",
                                                                         "comm.topk_ratio": 0.01}}, steps=40)
    (ref_losses, _, ref_sent), (losses, _, sent) = runs["none"], runs["topk"]
    ref_final, final = sum(ref_losses[-3:]) / 3, sum(losses[-3:]) / 3
    print(f"topk 1%: final loss {final:.4f} vs {ref_final:.4f}, bytes {sent[-1]:.0f} vs {ref_sent[-1]:.0f}")
    assert ref_final < ref_losses[0] - 1.0
    assert abs(final - ref_final) < TOPK_1PCT_MARGIN, (final, ref_final)
    # (index, value) pairs of 1 % of the entries from each of 4 ranks: under a tenth of the dense bytes
    assert sent[-1] < 0.1 * ref_sent[-1], (sent[-1], ref_sent[-1])


def _sgd_regression(compression: str, steps: int = 200, lr: float = 0.5) -> list[float]:
    """A linear model fitted to a linear teacher by plain SGD through DataParallel with
    ``GradientAllReduce("native", compression, topk_ratio=0.01)``; each rank its own quarter of
    the batch. Returns the mean loss over ranks per step."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.dist.comm.compress import GradientAllReduce
    from shardwise.parallel import DataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    d_in, d_out, batch = 128, 32, 32
    teacher = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(0)) / d_in**0.5
    torch.manual_seed(1)
    model = torch.nn.Linear(d_in, d_out)  # 4128 parameters: top-k sends 42 of them per rank and step
    dp = DataParallel(model, all_reduce_fn=GradientAllReduce("native", compression, topk_ratio=0.01))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x = torch.randn(batch * world, d_in, generator=torch.Generator().manual_seed(10_000 + step))
        y = x @ teacher.T
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(dp(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


SGD_TOPK_TOLERANCE = 0.05
"""Final loss (mean of the last 5 of 200 steps, starting from 1.29) of top-k 1 % SGD on 4 ranks may
exceed uncompressed SGD's by at most this. Measured: uncompressed 1e-5, top-k 0.0044; top-k with its
error feedback removed 0.50, a compressor that delivers zeros 1.31."""


def test_topk_one_percent_with_error_feedback_converges_like_sgd():
    """Error feedback is what makes 1 % top-k converge (Stich et al. 2018, Thm 2.4; Lin et al. 2018
    §3): every gradient entry dropped now is carried until it is sent."""
    ref = run_on_ranks(4, _sgd_regression, "none")[0]
    topk = run_on_ranks(4, _sgd_regression, "topk")[0]
    ref_final, final = sum(ref[-5:]) / 5, sum(topk[-5:]) / 5
    print(f"SGD, top-k 1%: final loss {final:.5f} vs uncompressed {ref_final:.5f} (from {ref[0]:.3f})")
    assert ref_final < 1e-3 * ref[0]
    assert final - ref_final < SGD_TOPK_TOLERANCE, (final, ref_final)
