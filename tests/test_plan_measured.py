"""Predicted beside measured on CPU: activation bytes (the tensors autograd saves for backward)
and model-state bytes of the layouts the trainer runs today (data parallel and ZeRO-1/2/3 on 2
and 4 gloo ranks, ZeRO++ hpZ, fp32 states), to the byte; a pipeline's point-to-point bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.config import Config
from shardwise.config_resolve import resolve
from shardwise.model.transformer import Transformer
from shardwise.plan.memory import STATE_CONVENTIONS, activation_mode, memory_breakdown
from shardwise.plan.spec import Layout, model_spec
from shardwise.train.precision import autocast_context


def saved_tensor_bytes(model: Transformer, tokens: torch.Tensor, precision: str) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters and buffers excluded."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context(precision, "cpu"):
        loss = model(tokens, tokens)
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("preset", ["cpu-demo", "tiny-llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_bytes_within_10_percent(preset, precision):
    cfg = resolve(Config.load(overrides={"model.preset": preset}), world_size=1, tokenizer_vocab=257)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    b, s = 2, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s))
    measured = saved_tensor_bytes(model, tokens, precision)
    states = STATE_CONVENTIONS["shardwise"]
    mem = memory_breakdown(model_spec(cfg), Layout(micro_batch=b), s, states, "flash",
                           activation_mode(precision, states))
    predicted = mem.by_metric()["mem_activations_bytes"]
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


def test_model_state_bytes_equal_the_trainers_tensors():
    """fp32 weights and gradients and AdamW's two fp32 moments: exactly the tensors the trainer holds."""
    cfg = resolve(Config.load(overrides={"model.preset": "tiny-llama"}), world_size=1, tokenizer_vocab=257)
    model = Transformer(cfg.model)
    model(torch.randint(0, 257, (1, 8)), torch.randint(0, 257, (1, 8))).backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    optim = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
                if k in ("exp_avg", "exp_avg_sq"))
    mem = memory_breakdown(model_spec(cfg), Layout(), 64, STATE_CONVENTIONS["shardwise"]).by_metric()
    assert (mem["mem_params_bytes"], mem["mem_grads_bytes"], mem["mem_optimizer_bytes"]) == (weights, grads, optim)



# ---- one layer's activations in 16 bits, to the byte ---------------------------------------------


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in ``module(x)`` (parameters and buffers excluded;
    views of one storage, e.g. Q, K and V cut from one projection, counted once)."""
    skip = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    storages: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


def _layer_norm_stats(s: int, b: int) -> int:
    """What Korthikanti et al. leave out ("small buffers"): the mean and 1/std per row that each of
    a layer's two LayerNorms saves, bf16 on CPU."""
    return 2 * 2 * 2 * s * b


class MegatronLayerShard(torch.nn.Module):
    """One tensor-parallel rank's share of a GPT layer as Megatron-LM runs it, the computation
    Korthikanti et al. 2022 §4.1 count for Table 2: pre-norm, a fused QKV projection (column
    parallel: n_heads / t heads), eager attention (QK^T scaled inside baddbmm, softmax and dropout
    in 16 bits, the dropout mask one byte per element), the row-parallel output projection, the MLP
    h -> 4h/t -> h, dropout on both residual branches. The tensor-parallel collectives save nothing
    and are identities on one process, so they are left out."""

    def __init__(self, h: int, a: int, t: int, p: float = 0.1):
        super().__init__()
        self.head_dim, self.heads, self.p = h // a, a // t, p
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h // t)
        self.proj = torch.nn.Linear(h // t, h)
        self.fc1 = torch.nn.Linear(h, 4 * h // t)
        self.fc2 = torch.nn.Linear(4 * h // t, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, h]
        s, b, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b * self.heads, 3 * self.head_dim).chunk(3, dim=-1)
        q, k, v = (z.transpose(0, 1) for z in (q, k, v))  # [b * heads, s, head_dim]
        scores = torch.baddbmm(torch.empty(b * self.heads, s, s, dtype=x.dtype), q, k.transpose(1, 2),
                               beta=0.0, alpha=self.head_dim**-0.5)
        probs, _ = torch.native_dropout(torch.softmax(scores, dim=-1), self.p, True)
        context = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, self.heads * self.head_dim)
        x = x + torch.native_dropout(self.proj(context), self.p, True)[0]
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x + torch.native_dropout(y, self.p, True)[0]


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("h, a, s, b", [(128, 8, 64, 2), (64, 4, 96, 3)])
def test_korthikanti_table2_measured(h, a, s, b, t):
    """Table 2's closed forms (34sbh + 5as^2b without parallelism, sbh(10 + 24/t + 5as/(ht)) per
    tensor-parallel rank) equal the bytes autograd keeps for a bf16 Megatron layer, up to the
    LayerNorm statistics the paper leaves out -- and so does the planner's term-by-term count."""
    from shardwise.plan.memory import activation_bytes_per_layer, korthikanti_table2
    from shardwise.plan.spec import ModelSpec

    torch.manual_seed(0)
    layer = MegatronLayerShard(h, a, t).to(torch.bfloat16)
    measured = _saved_bytes(layer, torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True))
    published = korthikanti_table2(s, b, h, a, t)["none" if t == 1 else "tp"]
    assert measured == published + _layer_norm_stats(s, b)
    m = ModelSpec("gpt2", 1, h, a, a, 4 * h, 100, s, True, dropout=0.1)
    assert activation_bytes_per_layer(m, s, b, t, attention="eager", mode="16bit") == published


@pytest.mark.parametrize("h, a, s, b", [(256, 8, 128, 2), (128, 4, 64, 3)])
def test_planner_layer_bytes_equal_our_block_in_bf16(h, a, s, b):
    """shardwise's own GPT-2 block, all in bf16 and without dropout (scaled_dot_product_attention
    then keeps its output and an fp32 log-sum-exp, no s x s matrix): the planner's per-layer
    count in the 16-bit convention equals what autograd saves, up to the LayerNorm statistics."""
    from shardwise.model.transformer import Block
    from shardwise.plan.memory import activation_bytes_per_layer

    cfg = Config.load(overrides={"model.preset": "cpu-demo", "model.d_model": str(h), "model.n_heads": str(a),
                                 "model.max_seq_len": str(s), "data.seq_len": str(s)})
    cfg = resolve(cfg, world_size=1, tokenizer_vocab=257)
    block = Block(cfg.model, 0).to(torch.bfloat16).train()
    measured = _saved_bytes(block, torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True))
    predicted = activation_bytes_per_layer(model_spec(cfg), s, b, attention="flash", mode="16bit")
    assert measured == predicted + _layer_norm_stats(s, b)


# ---- ZeRO: the engine's padded flat units, predicted == measured to the byte ------------------

ODD = {"model.d_model": 6, "model.n_heads": 2, "model.d_ff": 17}
"""A tiny GPT whose flat units are not multiples of 2 or 4 elements, so padding shows."""
CASES = [(1, 0.001, 1, 1), (2, 0.001, 1, 1), (3, 25.0, 1, 1), (3, 25.0, 2, 1), (3, 25.0, 1, 2)]
"""(ZeRO stage, parallel.bucket_mb, parallel.zero_unit, parallel.zero_hpz): small buckets make several
ZeRO-1/2 units; hpZ 2 adds the secondary partitions of the non-root units."""
TRAINED = {2: [(1, 1), (2, 1), (3, 1)], 4: [(1, 1), (2, 1), (3, 1), (3, 2)]}
"""Per world size, (stage, zero_hpz) also run through the trainer (two steps: --compare leaves out
step 1), for ``shardwise plan --compare``; its runs use 1 kB buckets, so that ZeRO-1/2's units are
padded too."""


def _odd_config(run_dir: Path, cache_dir: Path, nproc: int, **overrides) -> Config:
    from tests.test_train import make_config

    run = {"train.steps": 2, "train.global_batch": 4,  # ZeRO-3 has units, not buckets (bucket_mb is refused)
           "parallel.bucket_mb": 25 if overrides["parallel.zero"] == 3 else 0.001}
    return make_config(run_dir, cache_dir, nproc, **ODD, **run, **overrides)


def _zero_bytes_on_rank(cases, jobs):
    """Rank body: the accountant's bytes for each case (engine built directly, one AdamW step),
    then the trainer's runs (rank 0's ``metrics.jsonl`` holds its accountant's bytes)."""
    import torch.distributed as dist

    from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer
    from shardwise.train.memory import model_state_bytes
    from shardwise.train.optim import build_optimizer
    from tests.test_train import _train_on_rank

    measured = []
    for cfg, (stage, bucket_mb, zero_unit, hpz) in zip(jobs[0], cases, strict=True):
        model = Transformer(cfg.model)
        engine = ZeroDataParallel(model, stage=stage, bucket_mb=bucket_mb, unit_blocks=zero_unit, hpz_size=hpz)
        opt = ZeroOptimizer(engine, build_optimizer(model, cfg.train))
        x = torch.randint(0, cfg.model.vocab_size, (2, 16))
        engine(x, x).backward()
        opt.step()
        measured.append(model_state_bytes(engine, opt))
    for cfg, run_dir in jobs[1]:
        _train_on_rank(cfg, run_dir)
    return dist.get_rank(), measured


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """Per world size: (per-rank accountant bytes for CASES, run dirs of the TRAINED stages, a config)."""
    from tests.harness import run_on_ranks

    tmp = tmp_path_factory.mktemp("plan-zero")
    out = {}
    for world in (2, 4):
        cfgs = [resolve(_odd_config(tmp / f"direct{world}", tmp / "cache", world, **{"parallel.zero": st}),
                        world_size=world, tokenizer_vocab=257) for st, _, _, _ in CASES]
        runs = [(_odd_config(tmp / f"z{st}h{h}_w{world}", tmp / "cache", world,
                             **{"parallel.zero": st, "parallel.zero_hpz": h}), str(tmp / f"z{st}h{h}_w{world}"))
                for st, h in TRAINED[world]]
        replies = run_on_ranks(world, _zero_bytes_on_rank, CASES, (cfgs, runs))
        out[world] = ({rank: measured for rank, measured in replies}, [Path(r) for _, r in runs], cfgs[0])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_zero_layout_equals_the_engines_units(zero_runs, world):
    """Every rank's parameter, gradient, master and optimizer bytes, for every case, exactly."""
    from shardwise.plan.zero_layout import engine_state_bytes, model_params, zero_units

    per_rank, _, cfg = zero_runs[world]
    params = model_params(model_spec(cfg))
    b = STATE_CONVENTIONS["shardwise"].bytes()
    padded = False
    for i, (stage, bucket_mb, zero_unit, hpz) in enumerate(CASES):
        units = zero_units(params, stage, world, bucket_mb, zero_unit, hpz)
        padded |= units.padding > 0
        assert (units.secondary_numel > 0) == (hpz > 1)
        for rank in range(world):
            got = {k: v for k, v in per_rank[rank][i].items() if k in ("params", "grads", "master", "optimizer")}
            assert engine_state_bytes(units, b, rank) == got, (stage, bucket_mb, zero_unit, hpz, rank)
    assert padded  # the test model really exercises the padding


@pytest.mark.parametrize("world", [2, 4])
def test_planner_zero_bytes_equal_the_trainers_metrics(zero_runs, world, capsys):
    """``shardwise plan --compare`` on ZeRO-1/2/3 runs (and ZeRO-3 with hpZ 2 on 4 ranks): predicted
    model-state bytes and the bytes handed to collectives (padded units; ZeRO-3's root gathered once;
    hpZ's backward gathers hand over the full buffer, inside the node) == measured, and so are the bytes
    put on the wire."""
    from shardwise.plan.compare import compare_run, measured_for_run, predicted_for_run

    _, run_dirs, _ = zero_runs[world]
    params = {}
    for run_dir in run_dirs:
        cfg = Config.load(run_dir / "config.toml")
        pred, meas = predicted_for_run(cfg), measured_for_run(run_dir)
        params[(cfg.parallel.zero, cfg.parallel.zero_hpz)] = meas["mem_params_bytes"]
        for key in ("mem_params_bytes", "mem_grads_bytes", "mem_master_bytes", "mem_optimizer_bytes",
                    "mem_total_bytes", "comm_bytes"):
            assert pred[key] == meas[key], (run_dir.name, key, pred[key], meas[key])
        # on gloo ZeRO's reduce-scatters and gathers (hpZ's node gathers too) are our direct exchanges and its
        # flags our ring: every byte on the wire is counted at its send, and equals the cost model's (N-1)/N,
        # (h-1)/h and 2(N-1)/N (the flags' ring segments round on 4 ranks)
        assert meas["comm_backend_bytes"] == 0, run_dir.name
        assert meas["comm_sent_bytes"] == pytest.approx(pred["comm_sent_bytes"], rel=0 if world == 2 else 1e-3)
        assert compare_run(run_dir, as_json=False) == 0
        rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line}
        assert rows["mem_total_bytes"][-1] == "1.000"  # the printed measured/predicted ratio
    if (3, 2) in params:  # the secondary partitions really are there
        assert params[(3, 2)] > params[(3, 1)]


def test_paper_formula_stays_visible():
    """The unpadded Ψ/N_d of the paper is kept beside the engine's padded bytes."""
    cfg = Config.load(overrides={"model.preset": "tiny", **{k: str(v) for k, v in ODD.items()}})
    m = model_spec(cfg)
    mem = memory_breakdown(m, Layout(dp=4, zero=3), 32, STATE_CONVENTIONS["shardwise"])
    line = next(x for x in mem.lines if x.name == "mem_params_bytes")
    assert line.paper_bytes == 4 * (m.vocab_size * 6 + m.max_seq_len * 6 + 12 + 2 * 419) / 4
    assert line.bytes == 4 * (485 + 105 + 105) > line.paper_bytes and "padded" in line.formula


# ---- pipeline: rank 0's point-to-point bytes --------------------------------------------------

PP_RUNS = {
    "1f1b-fp32": {"parallel.pp_schedule": "1f1b"},
    "interleaved-bf16": {"parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2, "train.precision": "bf16"},
}


@pytest.mark.parametrize("name", list(PP_RUNS))
def test_planner_pipeline_bytes_equal_the_trainers_metrics(tmp_path, name, capsys):
    """pp=2, 4 micro-batches of 2, tiny GPT (tied table): ``pp_sent_bytes`` (fp32 activations and
    their gradients sent by rank 0, plus the tied table's gradient), ``comm_bytes`` and
    ``comm_sent_bytes`` predicted == measured, in bf16 too (the residual stream stays fp32)."""
    from shardwise.plan.compare import compare_run, measured_for_run, predicted_for_run
    from tests.test_train import run

    run(tmp_path, tmp_path / "cache", "pp", 2, **{"model.n_layers": 4, "train.steps": 2, "parallel.pp": 2,
                                                  "parallel.microbatches": 4}, **PP_RUNS[name])
    run_dir = tmp_path / "pp"
    pred, meas = predicted_for_run(Config.load(run_dir / "config.toml")), measured_for_run(run_dir)
    v = PP_RUNS[name].get("parallel.pp_virtual", 1)
    assert pred["pp_sent_bytes"] == (2 * v - 1) * 4 * (2 * 32 * 64 * 4) + 257 * 64 * 4  # 131328 with v = 1
    for key in ("pp_sent_bytes", "comm_bytes", "comm_sent_bytes"):
        assert pred[key] == meas[key], (name, key, pred[key], meas[key])
    assert compare_run(run_dir) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line}
    assert rows["pp_sent_bytes"][-1] == "1.000"


# ---- data parallel with our ring all-reduce: the bytes on the wire, counted at every send ------


@pytest.mark.parametrize("world", [2, 4])
def test_ring_all_reduce_wire_bytes_equal_the_cost_model(tmp_path, world):
    """With ``comm.algorithm ring`` every gradient byte travels by our point-to-point sends, so the
    trainer counts what rank 0 put on the wire (``comm_sent_bytes``) at each ``isend``; the planner
    predicts it from the ring's cost formula 2(N-1)/N per bucket (Patarasuk & Yuan 2009). Two
    independent numbers: equal on 2 ranks, and on 4 up to the rounding of uneven ring segments.
    With the backend's all-reduce no wire count exists and none is reported."""
    from shardwise.plan.compare import measured_for_run, predicted_for_run
    from tests.test_train import run

    for alg in ("ring", "native"):
        run(tmp_path, tmp_path / "cache", alg, world, **{"train.steps": 3, "comm.algorithm": alg,
                                                         "parallel.bucket_mb": 0.05})
        run_dir = tmp_path / alg
        pred, meas = predicted_for_run(Config.load(run_dir / "config.toml")), measured_for_run(run_dir)
        assert pred["comm_bytes"] == meas["comm_bytes"] == meas["dp_sent_bytes"], alg
        if alg == "native":
            assert "comm_sent_bytes" not in meas and meas["comm_backend_bytes"] == meas["comm_bytes"]
            continue
        assert meas["comm_backend_bytes"] == 0
        assert meas["comm_sent_bytes"] == pytest.approx(pred["comm_sent_bytes"], rel=0 if world == 2 else 1e-3)
        assert meas["comm_sent_bytes"] != pytest.approx(meas["comm_bytes"], rel=1e-2) or world == 2
