"""ZeRO-3 starts from a model on the meta device: each rank materialises only its own shards.

* the shards, buffers and tied weights are bit for bit (atol = 0) those of the old start (whole model
  built on every rank, rank 0's weights broadcast, slices kept), for both model flavours, on 4 ranks,
  through the trainer's :class:`~shardwise.train.engine.Engine`;
* the peak resident memory a ZeRO-3 rank gains while the engine is built stays far below the full
  model's fp32 bytes (a ~170 MB model on 4 ranks), while the old start gains more than the model;
* ranks that disagree (another seed) are told so instead of training different models.

Equal training (losses, weights, resharded resume) through the trainer is in tests/test_zero.py,
whose ZeRO-3 runs all start this way.
"""

from __future__ import annotations

import ctypes
import gc
import re
from pathlib import Path

import pytest
import torch

from tests.harness import run_on_ranks

WORLD = 4


def _config(world: int, **overrides):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve

    base = {"model.preset": "tiny", "parallel.zero": "3", "train.seed": "7"}
    base.update({k: str(v) for k, v in overrides.items()})
    return resolve(Config.load(overrides=base), world_size=world, tokenizer_vocab=256)


def _zero_engine(cfg, run_dir: str):
    import torch.distributed as dist

    from shardwise.dist.mesh import ParallelDims
    from shardwise.train.engine import Engine

    mesh = ParallelDims.from_config(cfg.parallel, dist.get_world_size()).build()
    return Engine(cfg, mesh, torch.device("cpu"), Path(run_dir))


def _old_start(cfg):
    """The start before meta-device initialisation: the whole model on every rank, then shard it."""
    from shardwise.model import Transformer
    from shardwise.parallel.zero import ZeroDataParallel

    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model)
    model.reset_parameters(cfg.train.seed)
    return ZeroDataParallel(model, stage=3, bucket_mb=cfg.parallel.bucket_mb, unit_blocks=cfg.parallel.zero_unit)


def _compare_starts(run_dir: str, presets: list[str]):
    """Rank body: per preset, the meta-built engine's ZeRO shards, buffers and first loss against the old start."""
    out = {}
    for preset in presets:
        cfg = _config(WORLD, **{"model.preset": preset, "parallel.zero_unit": 1})
        new = _zero_engine(cfg, run_dir).wrapper
        old = _old_start(cfg)
        model = new.module
        assert not any(p.is_meta for p in model.parameters()), preset
        assert not any(b.is_meta for b in model.buffers()), preset
        if cfg.model.tie_embeddings:
            assert model.lm_head.weight is model.tok_emb.weight
        assert [u.names for u in new.units] == [u.names for u in old.units]
        shards = [torch.equal(a.shard, b.shard) for a, b in zip(new.units, old.units, strict=True)]
        buffers = {n: torch.equal(a, b) for (n, a), (_, b) in zip(model.named_buffers(),
                                                                     old.module.named_buffers(), strict=True)}
        x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            losses = (float(new(x, x)), float(old(x, x)))
        out[preset] = shards, buffers, losses
    return out


def test_meta_start_equals_the_old_start_exactly(tmp_path):
    for rank, per_preset in enumerate(run_on_ranks(WORLD, _compare_starts, str(tmp_path), ["tiny", "tiny-llama"])):
        for preset, (shards, buffers, (new_loss, old_loss)) in per_preset.items():
            assert all(shards), (rank, preset, shards)
            assert all(buffers.values()), (rank, preset, buffers)
            assert new_loss == old_loss, (rank, preset)


# ---- peak memory at start-up ---------------------------------------------------------------------


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _reset_peak() -> bool:
    """Start a new peak-RSS measurement (Linux: writing 5 to clear_refs resets VmHWM to VmRSS)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return _status("VmHWM") <= _status("VmRSS") + (1 << 20)


def _release_free_memory() -> None:
    """Collect garbage and hand the allocator's free memory back to the system (glibc's malloc_trim), so
    that a measurement does not reuse memory an earlier one freed."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _startup_growth(run_dir: str):
    """Rank body: peak RSS gained while building ZeRO-3 (meta start, then the old start), the model's
    fp32 bytes, this rank's shard bytes and the largest parameter's bytes; ``None`` if unmeasurable."""
    overrides = {"model.preset": "cpu-demo", "model.d_model": 768, "model.n_layers": 6, "data.seq_len": 128}
    cfg = _config(WORLD, **overrides)
    _zero_engine(_config(WORLD), run_dir)  # imports, process groups, first-use allocations: not measured
    growth = {}
    for start in ("meta", "old"):
        _release_free_memory()
        if not _reset_peak():
            return None
        before = _status("VmRSS")
        engine = _zero_engine(cfg, run_dir).wrapper if start == "meta" else _old_start(cfg)
        growth[start] = _status("VmHWM") - before
        if start == "meta":
            full = sum(u.numel for u in engine.units) * 4
            shard = sum(u.shard_numel for u in engine.units) * 4
            largest = max(n for u in engine.units for n in u.numels) * 4
        del engine
    return growth, full, shard, largest


def test_zero3_rank_never_holds_the_full_model_at_start_up(tmp_path):
    """A ~170 MB fp32 model on 4 ranks: building the ZeRO-3 engine raises a rank's peak RSS by less than
    half the model (its shard is a quarter, plus one parameter's full initial value at a time), where
    the old start (whole model, broadcast, slice) raised it by more than the whole model."""
    results = run_on_ranks(WORLD, _startup_growth, str(tmp_path), timeout=600)
    if any(r is None for r in results):
        pytest.skip("peak RSS cannot be reset here (/proc/self/clear_refs is not writable)")
    for rank, (growth, full, shard, largest) in enumerate(results):
        assert 150e6 < full < 200e6, full
        assert growth["old"] > 0.9 * full, (rank, growth, full)  # the measurement sees a full model
        assert growth["meta"] < full / 2, (rank, growth, full, shard, largest)
        assert growth["meta"] < shard + 2 * largest + (24 << 20), (rank, growth, shard, largest)


# ---- ranks that disagree -------------------------------------------------------------------------


def _disagreeing_seed():
    """Rank body: rank 1 initialises with another seed; every rank must raise, naming a parameter."""
    import torch.distributed as dist

    from shardwise.model import Transformer
    from shardwise.model.transformer import initial_value
    from shardwise.parallel.zero import ZeroDataParallel
    from shardwise.parallel.zero.meta import materialize_buffers

    cfg = _config(2)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    materialize_buffers(model, "cpu")
    names = {id(p): n for n, p in model.named_parameters_for_init()}
    seed = 1 if dist.get_rank() == 1 else 0

    def init(_name, p):
        return initial_value(names[id(p)], p.shape, seed, init_std=cfg.model.init_std, n_layers=cfg.model.n_layers)

    try:
        ZeroDataParallel(model, stage=3, param_init=init)
    except ValueError as e:
        return str(e)
    return None


def test_ranks_with_different_seeds_are_refused():
    for message in run_on_ranks(2, _disagreeing_seed):
        assert message is not None and "different initial values" in message, message


def _misuse():
    """Rank body: the errors of a meta model without ``param_init``, and with buffers left on meta."""
    from shardwise.model import Transformer
    from shardwise.parallel.zero import ZeroDataParallel

    cfg = _config(1, **{"model.preset": "tiny-llama"})
    messages = []
    for init in (None, lambda _name, p: torch.zeros(p.shape)):
        with torch.device("meta"):
            model = Transformer(cfg.model)
        try:
            ZeroDataParallel(model, stage=3, param_init=init)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_meta_start_misuse_is_reported():
    no_init, meta_buffers = run_on_ranks(1, _misuse)[0]
    assert "pass param_init" in no_init
    assert "materialise buffers first" in meta_buffers and "rope" in meta_buffers
