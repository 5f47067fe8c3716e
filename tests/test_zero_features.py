"""ZeRO options tested on the engine directly (no trainer): hierarchical partitioning (ZeRO++
hpZ), parameters without gradients, and disk offload streamed per unit.

Tolerances: hpZ is **exact** (atol = 0; the secondary partition holds the very values the
forward gather produced). The unused-parameter runs on 2 ranks are exact as well (see
tests/test_zero.py for why a two-rank reduce-scatter equals the all-reduce bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_on_ranks


def _tiny_model():
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer

    cfg = resolve(Config.load(overrides={"model.preset": "tiny"}), world_size=2, tokenizer_vocab=256)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.reset_parameters(0)
    return model


def _batches(steps: int, vocab: int, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(steps)]


def _hpz_run(hpz_size: int, quant_weights: bool, steps: int = 3):
    """Rank body: ZeRO-3 on the tiny model for ``steps`` AdamW steps; returns losses, weights,
    gather traffic per step, the secondary bytes alive between forward and backward, the accounting."""
    import torch.distributed as dist

    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer, full_model_state
    from shardwise.parallel.zero.hpz import secondary_bytes_held

    model = _tiny_model()
    engine = ZeroDataParallel(model, stage=3, hpz_size=hpz_size, node_size=2, quant_weights=quant_weights)
    opt = ZeroOptimizer(engine, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    losses, traffic, held = [], [], []
    for x in _batches(steps, model.cfg.vocab_size, dist.get_rank()):
        loss = engine(x, x)
        held.append(secondary_bytes_held(engine.units))
        loss.backward()
        held.append(secondary_bytes_held(engine.units))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        traffic.append(engine.pop_gather_traffic())
    weights = full_model_state(engine)
    return losses, weights, traffic, held, engine.model_state_bytes(), [u.padded_numel for u in engine.units]


def _hpz_all():
    return {(h, q): _hpz_run(h, q) for h in (1, 2) for q in (False, True)}


def test_hierarchical_partitioning_on_four_ranks():
    """hpZ with nodes of 2 of 4 ranks: the same losses and weights as without (exactly); the
    backward gathers send nothing across nodes (counted at every send, by destination: our exchange on
    gloo; qwZ's int8 gathers run in the backend and are only handed over), so per step the inter-node
    gather bytes halve
    (forward only; the root unit is gathered once either way); the accountant counts the secondary
    partitions (padded_numel / 2 elements per non-root unit), which are alive only from forward
    to the end of backward."""
    results = run_on_ranks(4, _hpz_all)
    for rank, per_rank in enumerate(results):
        for q in (False, True):
            off, on = per_rank[(1, q)], per_rank[(2, q)]
            assert on[0] == off[0], (rank, q)  # losses, bit for bit
            for key, value in off[1].items():
                torch.testing.assert_close(on[1][key], value, atol=0, rtol=0, msg=key)
            for t_off, t_on in zip(off[2], on[2], strict=True):  # bytes counted at each send, by destination
                assert t_on["backward_inter_node"] == 0 and t_on["backward_intra_node"] > 0
                if q:  # qwZ's int8 gathers are the backend's: their bytes are handed over, not seen on the wire
                    assert t_off["backend_gather_bytes"] > 0
                    assert t_off["forward_inter_node"] == t_off["backward_inter_node"] == 0
                    continue
                assert t_off["backend_gather_bytes"] == t_on["backend_gather_bytes"] == 0
                assert t_off["backward_inter_node"] > 0
                assert t_on["forward_inter_node"] == t_off["forward_inter_node"]
                assert t_on["backward_intra_node"] > t_off["backward_intra_node"]
                # forward and backward gather the same non-root units: inter-node bytes halve
                root = on[5][0] * 4 * 2 // 4  # the root's share sent to the other node (fp32, once)
                assert t_off["backward_inter_node"] == t_off["forward_inter_node"] - root
                assert t_off["forward_inter_node"] + t_off["backward_inter_node"] < 2 * t_on["forward_inter_node"]
            secondary = sum(n // 2 * 4 for n in on[5][1:])
            assert on[4]["params"] == off[4]["params"] + secondary
            assert on[3][0::2] == [secondary] * len(on[0])  # after forward: every non-root unit
            assert on[3][1::2] == [0] * len(on[0])  # after backward: freed
            assert off[3] == [0] * len(off[3])


# ---- parameters without a gradient ---------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.spare = nn.Parameter(torch.randn(16))
        """Used only while ``use_spare`` is set (by the test, per step and rank)."""
        self.use_spare = False

    def forward(self, h):
        h = torch.tanh(self.lin(h))
        return h * self.spare if self.use_spare else h


class _Toy(nn.Module):
    """Two blocks with an occasionally used parameter each, and a never used root parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.never = nn.Parameter(torch.randn(5))
        self.head = nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def _spare_schedule(step: int, rank: int) -> bool:
    """Step 0: every rank uses the spare parameters; step 1: rank 0 only; then none."""
    return step == 0 or (step == 1 and rank == 0)


def _unused_run(kind: str, steps: int = 4):
    """Rank body: train ``_Toy`` with AdamW (weight decay on) under ``kind`` ("dp" = our
    DataParallel + torch AdamW, or "z1"/"z2"/"z3"/"z3_cpu"); return the final weights."""
    import torch.distributed as dist

    from shardwise.parallel.data import DataParallel
    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer, full_model_state

    model, rank = _Toy(), dist.get_rank()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if kind == "dp":
        engine, opt = DataParallel(model), adamw
    else:
        engine = ZeroDataParallel(model, stage=int(kind[1]), bucket_mb=0.001,
                                  offload="cpu" if kind.endswith("cpu") else "none")
        opt = ZeroOptimizer(engine, adamw)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        for b in model.blocks:
            b.use_spare = _spare_schedule(step, rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
        engine(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return full_model_state(engine) if kind != "dp" else {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unused_all():
    return {kind: _unused_run(kind) for kind in ("dp", "z1", "z2", "z3", "z3_cpu")}


def test_parameters_without_gradients_are_skipped_like_data_parallel():
    """A parameter with no gradient on any rank is left alone by AdamW (no weight decay, no moment
    decay, no step count), one with a gradient on one rank only is averaged with zeros: ZeRO-1/2/3
    and CPU offload end with exactly the weights of DataParallel + torch AdamW on 2 ranks."""
    runs = run_on_ranks(2, _unused_all)[0]
    ref = runs["dp"]
    torch.manual_seed(0)
    assert torch.equal(ref["never"], _Toy().never)  # never used: untouched, weight decay included
    for kind in ("z1", "z2", "z3", "z3_cpu"):
        for key, value in ref.items():
            torch.testing.assert_close(runs[kind][key], value, atol=0, rtol=0, msg=f"{kind}: {key}")


# ---- disk offload streamed per unit --------------------------------------------------------------


def _disk_run(offload_dir: str, steps: int = 3):
    """Rank body: ZeRO-3 on the tiny model with and without disk offload; returns both runs'
    losses, weights and consolidated optimizer state, the most master + optimizer-state bytes
    resident at once during the disk run's steps, one unit's worth, and whether the state is
    hollow between steps; then reloads the optimizer state into a fresh disk run and returns it."""
    import torch.distributed as dist

    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer, full_model_state

    out = {}
    for offload in ("none", "disk"):
        model = _tiny_model()
        engine = ZeroDataParallel(model, stage=3, offload=offload, offload_dir=offload_dir)
        opt = ZeroOptimizer(engine, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
        losses = []
        for x in _batches(steps, model.cfg.vocab_size, dist.get_rank()):
            loss = engine(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[offload] = (losses, full_model_state(engine), opt.state_dict())
    disk = engine.masters.disk
    one_unit = max(3 * 4 * u.shard_numel for u in engine.units)  # master + two moments, fp32
    hollow = all(m.stride() == (0,) for m in opt.master_params()) and all(
        v.stride() == (0,) for st in opt.inner.state.values() for v in st.values() if v.dim() == 1)
    model = _tiny_model()  # resume the no-offload run's optimizer state into a fresh disk run
    engine = ZeroDataParallel(model, stage=3, offload="disk", offload_dir=offload_dir + "-reload")
    opt = ZeroOptimizer(engine, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    opt.load_state_dict(out["none"][2])
    return out, disk.peak_resident_bytes, one_unit, hollow, opt.state_dict()


def test_disk_offload_streams_one_unit_at_a_time(tmp_path):
    """Disk offload: the same losses, weights and optimizer state as no offload (exactly); during
    the step at most one unit's master weights and Adam moments are in memory (the rest stays in
    the files; between steps every master piece and moment is hollow); optimizer state loaded into
    a disk run comes back unchanged."""
    for rank, (runs, peak, one_unit, hollow, reloaded) in enumerate(run_on_ranks(2, _disk_run, str(tmp_path))):
        (l0, w0, s0), (l1, w1, s1) = runs["none"], runs["disk"]
        assert l1 == l0, rank
        for key, value in w0.items():
            torch.testing.assert_close(w1[key], value, atol=0, rtol=0, msg=key)
        for state in (s1, reloaded):
            for i, st in s0["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(state["state"][i][key], st[key], atol=0, rtol=0)
        assert 0 < peak <= one_unit, (peak, one_unit)
        assert hollow


def test_trainer_with_hpz_equals_plain_zero3(tmp_path, tmp_path_factory):
    """``--parallel.zero_hpz 2`` through the trainer: the same run as ZeRO-3 without it, bit for bit."""
    from tests.test_train import run

    cache = tmp_path_factory.mktemp("token-cache")
    zero3 = {"parallel.zero": 3, "train.steps": 3}
    plain = run(tmp_path, cache, "zero3", 4, **zero3)
    hpz = run(tmp_path, cache, "hpz", 4, **zero3, **{"parallel.zero_hpz": 2})
    assert plain[0] == hpz[0]
    for name, value in plain[1].items():
        assert torch.equal(value, hpz[1][name]), name


def test_bf16_flat_parameters_hold_half_the_parameter_and_gradient_bytes(tmp_path, cache_dir):
    """``--parallel.zero_param_dtype bf16``: the flat parameters and gradients (and their communication) are
    bf16 beside fp32 masters (the ZeRO paper's mixed precision), so the measured parameter and communicated
    bytes halve, the masters appear, and training follows the fp32 run; the weights the run ends with are the
    fp32 masters. The gradient slice is handed to the fp32 optimizer as an fp32 copy, which the paper's
    2 + 2 + 12 bytes per parameter leaves out: measured here beside the bf16 gradients (with CPU offload that
    copy, the masters and moments live on the host)."""
    from shardwise.train.metrics import read_metrics
    from tests.test_train import run

    base = {"parallel.zero": 2, "train.precision": "bf16", "train.steps": 3}
    fp32 = run(tmp_path, cache_dir, "fp32-params", 2, **base)
    bf16 = run(tmp_path, cache_dir, "bf16-params", 2, **base, **{"parallel.zero_param_dtype": "bf16"})
    mem = [read_metrics(tmp_path / name)[-1] for name in ("fp32-params", "bf16-params")]
    assert mem[1]["mem_params_bytes"] * 2 == mem[0]["mem_params_bytes"]
    assert mem[1]["mem_grads_bytes"] == mem[0]["mem_grads_bytes"] / 2 + mem[0]["mem_grads_bytes"]  # + fp32 slice
    assert mem[0]["mem_master_bytes"] == 0 and mem[1]["mem_master_bytes"] > 0  # fp32 params are the masters
    assert mem[1]["dp_sent_bytes"] * 2 == pytest.approx(mem[0]["dp_sent_bytes"], rel=1e-3)  # + a few flag bytes
    # the weights the run ends with are its fp32 masters -- the model -- not their bf16 rounding
    assert {v.dtype for v in bf16[1].values() if v.is_floating_point()} == {torch.float32}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in bf16[1].values() if v.dim() == 2)
    torch.testing.assert_close(torch.tensor(bf16[0]), torch.tensor(fp32[0]), atol=0.05, rtol=0)
