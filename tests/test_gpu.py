"""The GPU path: every engine on one NCCL rank, data parallelism on two gloo ranks with CUDA tensors,
bf16 autocast, ZeRO-Offload's pinned buffers and side stream, disk offload, checkpoints moved between
GPU and CPU. Marked ``gpu``: skipped (with the reason) where torch sees no CUDA device, so never in CI;
run them with ``python -m pytest -q -m gpu tests/test_gpu.py`` on a GPU machine.

One GPU hosts one NCCL rank only (NCCL refuses two ranks on one device), so the single-rank NCCL runs
happen in one spawned process of their own (an NCCL default group, "cpu:gloo,cuda:nccl", as
``shardwise train`` makes it), the multi-rank ones (data parallel, pipeline) on the harness's gloo
ranks sharing the GPU, and the pipeline and multi-rank ZeRO on NCCL only where there are two GPUs,
through the CLI. ZeRO on two gloo ranks with CUDA tensors is not run: it would call gloo's reduce-scatter
and all-gather on CUDA tensors, which torch's backend table lists as unsupported.

References are the same runs on the CPU (fp32; the GPU's matmuls and attention kernels sum in
another order, so losses agree to 2e-3 and weights to 1e-2 rather than exactly), and the GPU
data-parallel run for the other engines on the GPU (1e-4: the same kernels, another optimizer
implementation for offloaded masters). The tensor-, context- and expert-parallel cases and MoE are held
to 1e-5 against the same layout on the CPU, in fp32 with TF32 off (``NVIDIA_TF32_OVERRIDE=0`` for spawned
workers, highest matmul precision in-process): tp 2 on two gloo ranks sharing one GPU (its collectives are
all-reduces, which gloo runs on CUDA tensors), MoE on one NCCL rank, and -- where there are two GPUs --
tp 2 with sequence parallelism, ring cp 2 and ep 2 on two NCCL ranks through the CLI. Ring attention, our
pairwise all-to-all and the parameter server use point-to-point, which gloo runs on CPU tensors only:
the config refuses them with ``run.device='cuda'`` on gloo.

The GPU-only branches of issue 35 run here too: ZeRO's asynchronous checkpoint (pinned buffers filled on a side
stream), dropout's whole-tensor masks (the CPU's bits, no host synchronisation on the real device; and each mask
one compiled kernel outside a dispatch mode), the CUDA-event clock, and the communication thread's device.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_on_ranks
from tests.test_train import make_config, run

pytestmark = pytest.mark.gpu

GPU = {"run.device": "cuda", "parallel.backend": "nccl"}
CPU_FROM_GPU = (2e-3, 1e-2)
"""(loss, weight) tolerances of a GPU run against the same run on the CPU."""
SAME_DEVICE = 1e-4
STRICT_FP32 = 1e-5
"""Loss and weight tolerance of a GPU run against the same layout on the CPU in fp32 with TF32 off."""
NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}
"""For spawned workers: cuBLAS and cuDNN without TF32, whatever torch's flags say."""


def strict_fp32() -> None:
    """This process's matmuls and convolutions in full fp32 (no TF32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


@pytest.fixture(scope="module")
def nccl_process():
    """One spawned process that holds a one-rank NCCL default group for the module's tests."""
    pool = cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    yield pool
    pool.shutdown(cancel_futures=True)


def _train_gpu(cfg, run_dir: str, stop_after=None):
    """In the NCCL process: train, and say on which backend and device it ran."""
    import torch.distributed as dist

    from shardwise.train.loop import train

    strict_fp32()
    result = train(cfg, Path(run_dir), collect_state=True, stop_after=stop_after)
    return result.losses, result.state_dict, dist.get_backend_config()


def on_gpu(pool, tmp_path: Path, cache_dir: Path, name: str, stop_after=None, **overrides):
    run_dir = tmp_path / name
    cfg = make_config(run_dir, cache_dir, 1, **{**GPU, **overrides})
    losses, state, backends = pool.submit(_train_gpu, cfg, str(run_dir), stop_after).result(timeout=600)
    assert backends == "cpu:gloo,cuda:nccl"
    return losses, state


def assert_close(a, b, loss_atol: float, weight_atol: float):
    torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), atol=loss_atol, rtol=0)
    assert a[1].keys() == b[1].keys()
    for key in a[1]:
        torch.testing.assert_close(a[1][key], b[1][key], atol=weight_atol, rtol=0, msg=key)


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory, cache_dir):
    return run(tmp_path_factory.mktemp("cpu-ref"), cache_dir, "cpu", 1)


@pytest.fixture(scope="module")
def gpu_reference(nccl_process, tmp_path_factory, cache_dir):
    return on_gpu(nccl_process, tmp_path_factory.mktemp("gpu-ref"), cache_dir, "gpu")


def test_data_parallel_on_one_nccl_rank_equals_the_cpu(gpu_reference, cpu_reference):
    assert gpu_reference[0][-1] < gpu_reference[0][0]
    assert_close(gpu_reference, cpu_reference, *CPU_FROM_GPU)


@pytest.mark.parametrize("overrides", [
    {"parallel.zero": 1}, {"parallel.zero": 2}, {"parallel.zero": 3},
    {"parallel.zero": 1, "parallel.offload": "cpu"},
    {"parallel.zero": 2, "parallel.offload": "cpu"},
    {"parallel.zero": 3, "parallel.offload": "disk"},
    {"train.recompute": "full"},
], ids=lambda o: "-".join(f"{k.split('.')[1]}={v}" for k, v in o.items()))
def test_every_engine_on_one_nccl_rank(nccl_process, gpu_reference, tmp_path, cache_dir, overrides):
    if overrides.get("parallel.offload") == "disk":
        overrides = {**overrides, "parallel.offload_dir": str(tmp_path / "offload")}
    result = on_gpu(nccl_process, tmp_path, cache_dir, "run", **overrides)
    assert_close(result, gpu_reference, SAME_DEVICE, SAME_DEVICE)


def test_bf16_autocast_on_the_gpu(nccl_process, gpu_reference, tmp_path, cache_dir):
    losses, state = on_gpu(nccl_process, tmp_path, cache_dir, "bf16", **{"train.precision": "bf16"})
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(gpu_reference[0]), atol=0.1, rtol=0)  # bf16: 2^-8
    assert all(v.dtype == torch.float32 for v in state.values())  # fp32 weights, bf16 compute


def test_checkpoint_moves_between_gpu_and_cpu(nccl_process, gpu_reference, cpu_reference, tmp_path, cache_dir):
    """Saved on the GPU at step 5, resumed on the CPU; saved on the CPU, resumed on the GPU: each
    finishes as the uninterrupted run on the device it finished on (within the device tolerance)."""
    ckpt = {"ckpt.every": 5}
    on_gpu(nccl_process, tmp_path, cache_dir, "g2c", stop_after=5, **ckpt)
    on_cpu = run(tmp_path, cache_dir, "g2c", 1, **ckpt, **{"ckpt.resume": "true", "run.device": "cpu"})
    assert len(on_cpu[0]) == 5
    assert_close(on_cpu, (cpu_reference[0][5:], cpu_reference[1]), *CPU_FROM_GPU)

    run(tmp_path, cache_dir, "c2g", 1, stop_after=5, **ckpt, **{"run.device": "cpu"})
    on_gpu_again = on_gpu(nccl_process, tmp_path, cache_dir, "c2g", **ckpt, **{"ckpt.resume": "true"})
    assert_close(on_gpu_again, (gpu_reference[0][5:], gpu_reference[1]), *CPU_FROM_GPU)


def _offload_buffers() -> dict:
    """In the NCCL process: ZeRO-2 with CPU offload on a CUDA model -- where its buffers live."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.dist.mesh import init_distributed
    from shardwise.model import Transformer
    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer

    init_distributed("nccl")
    cfg = resolve(Config.load(overrides={"model.preset": "tiny"}), world_size=1, tokenizer_vocab=256)
    model = Transformer(cfg.model).cuda()
    engine = ZeroDataParallel(model, stage=2, offload="cpu")
    opt = ZeroOptimizer(engine, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 256, (2, 16), device="cuda")
    for _ in range(2):
        engine(x, x).backward()
        opt.step()
        opt.zero_grad()
    masters = engine.masters
    stream = masters._copy_stream
    return {
        "grad_buffers_pinned": all(b.is_pinned() for b in masters.grad_buffers()),
        "masters_pinned": all(m.is_pinned() for m in masters.params()),
        "side_stream": stream is not None and stream != torch.cuda.current_stream(),
        "shards_on_gpu": all(u.shard.is_cuda for u in engine.units),
    }


def test_cpu_offload_uses_pinned_buffers_and_a_side_stream(nccl_process):
    got = nccl_process.submit(_offload_buffers).result(timeout=300)
    assert got == dict.fromkeys(got, True), got


@pytest.mark.parametrize("overrides", [{}, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}], ids=["dp2", "pp2"])
def test_two_gloo_ranks_with_cuda_tensors_equal_the_cpu(cpu_reference, tmp_path, cache_dir, overrides):
    """Two harness ranks sharing the GPU: data parallelism (gloo's CUDA all-reduce and broadcast), and the
    pipeline, whose activations travel through host memory (gloo's point-to-point takes CPU tensors)."""
    result = run(tmp_path, cache_dir, "gloo-cuda", 2, **{"run.device": "cuda", "parallel.backend": "gloo"},
                 **overrides)
    assert_close(result, cpu_reference, *CPU_FROM_GPU)


def _cuda_tensors_in_harness() -> str:
    import torch.distributed as dist

    t = torch.ones(3, device="cuda")
    dist.all_reduce(t)
    return str(t.device)


def test_harness_guard_lets_cuda_tensors_through_gloo():
    assert run_on_ranks(2, _cuda_tensors_in_harness) == ["cuda:0", "cuda:0"]


def test_moe_on_one_nccl_rank_equals_the_cpu(nccl_process, tmp_path, cache_dir):
    """The mixture-of-experts model (router, stacked experts, aux and z losses) on the GPU: the CPU's losses
    and weights within 1e-5 (fp32, no TF32)."""
    moe = {"model.preset": "tiny-moe", "train.steps": 6}
    cpu = run(tmp_path, cache_dir, "moe-cpu", 1, **moe)
    gpu = on_gpu(nccl_process, tmp_path, cache_dir, "moe-gpu", **moe)
    assert_close(gpu, cpu, STRICT_FP32, STRICT_FP32)


def _train_strict(cfg, run_dir: str):
    """Harness rank body: train in full fp32 (no TF32); rank 0's (losses, weights)."""
    from tests.test_train import _train_on_rank

    strict_fp32()
    return _train_on_rank(cfg, run_dir)


def test_tensor_parallel_with_cuda_tensors_equals_the_cpu(tmp_path, cache_dir):
    """tp 2 on two gloo ranks sharing the GPU (Megatron's f and g, the vocabulary-parallel embedding and loss:
    all-reduces, which gloo runs on CUDA tensors) against tp 2 on the CPU: 1e-5."""
    tp = {"parallel.tp": 2, "train.steps": 6}
    cpu = run(tmp_path, cache_dir, "tp-cpu", 2, **tp)
    cfg = make_config(tmp_path / "tp-gpu", cache_dir, 2, **tp, **{"run.device": "cuda", "parallel.backend": "gloo"})
    gpu = run_on_ranks(2, _train_strict, cfg, str(tmp_path / "tp-gpu"))[0]
    assert_close(gpu, cpu, STRICT_FP32, STRICT_FP32)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with two ranks needs two GPUs")
@pytest.mark.parametrize("layout", [
    {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
    {"parallel.cp": 2, "parallel.cp_algorithm": "ring"},
    {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
    {"model.preset": "tiny-moe", "parallel.ep": 2},
], ids=["tp2-sp", "cp2-ring", "cp2-ulysses", "ep2-moe"])
def test_two_nccl_ranks_equal_the_same_layout_on_the_cpu(tmp_path, cache_dir, layout):
    """Tensor (with sequence parallelism), context (ring, Ulysses) and expert parallelism on two NCCL ranks, as a
    user starts them, against the same layout on two CPU ranks: losses and final weights within 1e-5."""
    from shardwise.train.checkpoint import list_checkpoints
    from shardwise.train.metrics import read_metrics
    from shardwise.train.state import open_checkpoint

    layout = {**layout, "train.steps": 6}
    losses, weights, _ = run(tmp_path, cache_dir, "cpu", 2, **layout)
    run_dir = tmp_path / "gpu"
    make_config(run_dir, cache_dir, 2, **layout)  # run_dir/config.toml, the same resolved config
    cmd = [sys.executable, "-m", "shardwise.cli", "train", str(run_dir / "config.toml"), "--run.device", "cuda",
           "--parallel.backend", "nccl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **NO_TF32})
    assert done.returncode == 0, done.stderr[-3000:]
    gpu_losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    saved = open_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1]).model_state()
    assert_close((gpu_losses, {k: saved[k] for k in weights}), (losses, weights), STRICT_FP32, STRICT_FP32)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with two ranks needs two GPUs")
@pytest.mark.parametrize("args", [
    ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--parallel.microbatches", "4"],
    ["--parallel.zero", "3"],
], ids=["pp2-1f1b", "zero3-dp2"])
def test_two_nccl_ranks_through_the_cli(tmp_path, cache_dir, args):
    """The pipeline and multi-rank ZeRO on NCCL, as a user starts them."""
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--model.preset", "tiny", "--data.max_bytes", "400000",
           "--data.seq_len", "32", "--data.cache_dir", str(cache_dir), "--train.steps", "6",
           "--train.global_batch", "8", "--run.device", "cuda", "--parallel.nproc", "2", "--ckpt.every", "3",
           "--run.dir", str(tmp_path / "run"), "--run.progress", "false", "--run.tensorboard", "false", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in lines) == 6


def test_async_zero_checkpoint_on_the_gpu_resumes_the_same_run(nccl_process, gpu_reference, tmp_path, cache_dir):
    """ZeRO-2 with ``ckpt.async``: the pieces of the shard are referenced, not copied, at the checkpoint step, and
    the background thread copies them into pinned buffers on a side stream that waits for the step's values; the
    run resumed from that checkpoint ends where the uninterrupted one does."""
    zero = {"parallel.zero": 2, "ckpt.async": "true", "ckpt.every": 5}
    on_gpu(nccl_process, tmp_path, cache_dir, "zckpt", stop_after=5, **zero)
    resumed = on_gpu(nccl_process, tmp_path, cache_dir, "zckpt", **zero, **{"ckpt.resume": "true"})
    assert_close(resumed, (gpu_reference[0][5:], gpu_reference[1]), SAME_DEVICE, SAME_DEVICE)


def test_dropout_masks_on_the_gpu_are_the_cpus_and_read_nothing_back():
    """The whole-tensor plan of a GPU draws the bits of the CPU's chunked plan (a causal attention site and a
    residual site), with no host synchronisation counted on the real device."""
    from shardwise.dispatch_count import DispatchCounter
    from shardwise.model.dropout import AttentionDropout, Dropout, DropoutKey, Span

    key = DropoutKey(seed=7, step=3, first_sequence=4)
    masks = {}
    for device in ("cpu", "cuda"):
        attn = AttentionDropout(0.1, key, 1, Span.whole(4, device))
        pos = torch.arange(256, device=device)
        residual = Dropout(0.1, "mlp_out", 1).train()
        with DispatchCounter(device) as counter:
            masks[device] = (attn.keep(2, pos, pos, 256, causal=True, keys_aligned=True),
                             residual(torch.ones(2, 256, 64, device=device), key) != 0)
        if device == "cuda":
            assert counter.counts.n_syncs == 0, counter.counts.syncs_by_site()
    for cpu, gpu in zip(masks["cpu"], masks["cuda"], strict=True):
        assert torch.equal(cpu, gpu.cpu())


def test_the_fused_dropout_masks_on_the_gpu_are_the_cpus():
    """Outside a dispatch mode a GPU draws each mask with one compiled kernel (MaskPlan.fused): the CPU's bits, for
    keys and layers that change, and no fallback to the eager draw."""
    from shardwise.model import dropout
    from shardwise.model.dropout import AttentionDropout, Dropout, DropoutKey, Span

    for step in (3, 4, 5):
        key = DropoutKey(seed=7, step=step, first_sequence=2 * step)
        masks = {}
        for device in ("cpu", "cuda"):
            attn = AttentionDropout(0.1, key, step, Span.whole(4, device))
            pos = torch.arange(256, device=device)
            residual = Dropout(0.1, "mlp_out", step).train()
            masks[device] = (attn.keep(2, pos, pos, 256, causal=True, keys_aligned=True),
                             residual(torch.ones(2, 256, 64, device=device), key) != 0)
        for cpu, gpu in zip(masks["cpu"], masks["cuda"], strict=True):
            assert torch.equal(cpu, gpu.cpu()), step
    assert dropout._FUSED.compiled is not None and dropout._FUSED.failed is None, dropout._FUSED.failed


def test_the_event_clock_times_the_kernel_not_the_launch():
    """CUDA events around a ~50 ms kernel measure it; the host clock around its launch does not."""
    from shardwise.dist.clock import EventClock, HostClock

    events, host = EventClock(), HostClock()
    torch.cuda.synchronize()
    start, h0 = events.stamp(), host.stamp()
    torch.cuda._sleep(100_000_000)
    end, h1 = events.stamp(), host.stamp()
    assert events.elapsed(start, end) > 5 * host.elapsed(h0, h1)


def test_the_comm_thread_runs_on_its_ranks_device():
    from shardwise.dist.comm.background import CommThread

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    thread = CommThread("test", device)
    job = thread.submit(torch.cuda.current_device)
    thread.join()
    assert job.result == device.index
