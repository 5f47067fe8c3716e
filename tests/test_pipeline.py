"""Pipeline parallelism: partitioning, schedules as data, and equivalence with one process.

Equivalence: for pp in {2, 4}, every schedule and micro-batch counts {1, p-1, p, 2p+1} where the
schedule allows them (naive: 1; interleaved with v=2: multiples of p), the loss and every parameter's
gradient equal a single-process forward/backward of the same global batch in fp32 within
``atol=1e-6, rtol=1e-5`` (the micro-batch sum changes the reduction order, so not bitwise). pp=2 x dp=2
uses a plain ``dist.all_reduce`` of the gradients over the dp group once, after ``Pipeline.step``.
The global gradient norm across stages equals the reference's (for clipping).
Weights of every stage equal the full model's exactly. All multi-process cases of one world size run
in one harness call.

ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1): split backward (B, then W), the
simulated bubble equals (p - 1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W) + that) for m >= p, peak live
micro-batches stay <= p, and pp in {2, 4} with m in {p - 1, p, 2p + 1} equals one process (same
tolerance); with block recomputation and bf16 autocast its gradients equal 1F1B's on the same
micro-batches (every nn.Linear weight/bias bit-equal, the rest within 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.dist import ParallelDims
from shardwise.parallel.pipeline import (
    Event,
    Pipeline,
    Timeline,
    balanced_split,
    bubble_fraction,
    build_schedule,
    build_stage,
    check_pipeline,
    compute_order,
    even_split,
    global_grad_norm,
    manual_split,
    peak_live,
    replayed_bubble,
    simulate,
    split_microbatches,
    theoretical_bubble,
    zb_h1_bubble,
)
from shardwise.parallel.pipeline.partition import partition
from tests.harness import run_on_ranks

ATOL, RTOL = 1e-6, 1e-5
SEQ = 8


def _cfg(n_layers: int = 4, preset: str = "tiny"):
    from shardwise.config import Config
    from shardwise.config_resolve import resolve

    cfg = Config.load(overrides={"model.preset": preset, "model.n_layers": str(n_layers)})
    return resolve(cfg, tokenizer_vocab=257).model


def _cases(p: int) -> list[tuple[str, int, int]]:
    """(schedule, m, v) for pp=p: micro-batch counts {1, p-1, p, 2p+1} where each schedule allows them."""
    ms = sorted({1, p - 1, p, 2 * p + 1})
    out = [("naive", 1, 1)]
    out += [(s, m, 1) for s in ("gpipe", "1f1b") for m in ms]
    out += [("interleaved", m, 2) for m in ms if m % p == 0]
    return out


# ---- partitioning (one process) ----------------------------------------------------------------


def test_even_and_manual_split():
    assert even_split(5, 2) == [range(0, 3), range(3, 5)]
    assert even_split(4, 4) == [range(i, i + 1) for i in range(4)]
    assert manual_split(4, [1, 3]) == [range(0, 1), range(1, 3), range(3, 4)]
    with pytest.raises(ValueError, match="strictly increasing"):
        manual_split(4, [3, 1])
    with pytest.raises(ValueError, match="exceed model.n_layers=4"):
        even_split(4, 5)


def test_balanced_split_minimises_the_largest_stage():
    # Heavy embedding on stage 0 pushes blocks to later stages; heavy head pulls them earlier.
    assert balanced_split([1, 1, 1, 1], 2, first_extra=2) == [range(0, 1), range(1, 4)]
    assert balanced_split([1, 1, 1, 1], 2, last_extra=2) == [range(0, 3), range(3, 4)]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    cfg = _cfg(6)
    for method in ("params", "flops"):
        split = partition(cfg, 3, method)
        assert [b for r in split for b in r] == list(range(6)) and all(len(r) for r in split)
    assert partition(cfg, 2, "manual", boundaries=[4]) == [range(0, 4), range(4, 6)]
    with pytest.raises(ValueError, match="not valid"):
        partition(cfg, 2, "bytes")


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_stages_hold_exactly_their_part_of_the_model(preset):
    from shardwise.model import Transformer

    cfg = _cfg(4, preset)
    full = Transformer(cfg)
    full.reset_parameters(seed=7)
    ref = dict(full.named_parameters_for_init())
    for p in (2, 4):
        seen = set()
        for s, blocks in enumerate(even_split(4, p)):
            stage = build_stage(cfg, s, p, blocks, seed=7)
            names = dict(stage.named_parameters())
            assert not any(t.is_meta for t in stage.parameters())
            assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {str(b) for b in blocks}
            for name, t in names.items():
                assert torch.equal(t, ref[name]), name
            seen |= set(names)
            if s == p - 1 and cfg.tie_embeddings:
                assert stage.lm_head.weight is stage.tok_emb.weight
        assert seen == set(ref)  # together the stages hold every parameter


# ---- schedules as data -------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4])
def test_schedules_are_complete_deadlock_free_and_match_theory(p):
    for schedule, m, v in _cases(p):
        acts = build_schedule(schedule, p, m, v)
        for r in range(p):
            order = compute_order(schedule, r, p, m, v)
            expected = {(k, c, i) for k in "FB" for c in range(v) for i in range(m)}
            assert sorted((a.kind, a.chunk, a.mb) for a in order) == sorted(expected), (schedule, r)
        makespan, spans = simulate(acts, t_f=1.0, t_b=2.0)
        busy = sum(e[4] - e[3] for r in spans for e in r)
        assert abs(1 - busy / (p * makespan) - theoretical_bubble(p, m, v)) < 1e-9, (schedule, m)
        peaks = [peak_live(a) for a in acts]
        if schedule == "1f1b":
            assert peaks == [min(p - r, m) for r in range(p)]
        elif schedule == "gpipe":
            assert peaks == [m] * p


def test_replayed_bubble_separates_unequal_stages_from_executing_cost():
    """The replay keeps what unequal computations cost and drops what the run added between them."""
    p, m, v = 2, 4, 2
    acts = build_schedule("interleaved", p, m, v)
    slow = {(0, "F", 1, i): 1.0 for i in range(m)}  # stage 2 (rank 0's 2nd chunk): forward twice the others'
    makespan, spans = simulate(acts, t_f=1.0, t_b=2.0, durations=slow)
    timelines = [Timeline(r, [Event(k, c * p + r, i, t0, t1) for k, c, i, t0, t1 in spans[r]], start=0.0,
                          end=makespan) for r in range(p)]
    replayed, replay_span = replayed_bubble(timelines, acts)
    assert replay_span == pytest.approx(makespan) and replay_span >= 14.0  # rank 0 alone computes 14 units
    assert replayed == pytest.approx(bubble_fraction(timelines)) and abs(replayed - theoretical_bubble(p, m, v)) > 0.02
    late = [Timeline(t.rank, [Event(e.kind, e.stage, e.mb, e.start + 0.5, e.end + 0.5) for e in t.events],
                     start=0.0, end=makespan + 1.0) for t in timelines]  # half a unit lost at each end
    assert replayed_bubble(late, acts)[0] == pytest.approx(replayed)
    assert bubble_fraction(late) > replayed


def test_clear_errors_before_spawning():
    with pytest.raises(ValueError, match="exceed model.n_layers=4"):
        check_pipeline(4, 4, "interleaved", 4, 8, virtual=2)
    with pytest.raises(ValueError, match="not a multiple of parallel.pp=2"):
        check_pipeline(8, 2, "interleaved", 3, 6, virtual=2)
    with pytest.raises(ValueError, match="pp_schedule='naive'"):
        check_pipeline(4, 2, "naive", 2, 8)
    with pytest.raises(ValueError, match="does not split into parallel.microbatches=3"):
        check_pipeline(4, 2, "1f1b", 3, 8)
    with pytest.raises(ValueError, match="pp_schedule='zb'"):
        check_pipeline(4, 2, "zb", 2, 8)
    with pytest.raises(ValueError, match="pp_virtual=2 needs pp_schedule='interleaved'"):
        check_pipeline(8, 2, "1f1b", 2, 8, virtual=2)
    with pytest.raises(ValueError, match="does not split"):
        split_microbatches(torch.zeros(5, 3), 2)
    with pytest.raises(ValueError, match="pp_virtual=2 needs pp_schedule='interleaved'"):
        check_pipeline(8, 2, "zb-h1", 2, 8, virtual=2)
    check_pipeline(4, 2, "zb-h1", 1, 8)  # any m >= 1 runs (m < p without a steady state)


def test_zb_h1_action_order():
    """Qi et al. 2024 Fig. 3 (ZB-H1) for p=2, m=4: rank 1 holds back one W, rank 0 none."""
    order = [[f"{a.kind}{a.mb}" for a in compute_order("zb-h1", r, 2, 4)] for r in range(2)]
    assert order[0] == "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3".split()
    assert order[1] == "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3".split()


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_schedule_is_complete_deadlock_free_and_matches_theory(p):
    for m in sorted({max(p - 1, 1), p, 2 * p + 1, 3 * p}):
        acts = build_schedule("zb-h1", p, m)
        for r in range(p):
            order = compute_order("zb-h1", r, p, m)
            assert sorted((a.kind, a.mb) for a in order) == sorted((k, i) for k in "FBW" for i in range(m))
            pos = {(a.kind, a.mb): n for n, a in enumerate(order)}
            assert all(pos["F", i] < pos["B", i] < pos["W", i] for i in range(m))
        assert [peak_live(a) for a in acts] == [min(p, m)] * p  # 1F1B's peak on rank 0, on every rank
        for t_f, t_b, t_w in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5)):
            makespan, spans = simulate(acts, t_f, t_b, t_w)
            bubble = 1 - sum(e[4] - e[3] for r in spans for e in r) / (p * makespan)
            theory = zb_h1_bubble(p, m, t_f, t_b, t_w)
            if m >= p:
                assert abs(bubble - theory) < 1e-9, (m, t_f, t_b, t_w, bubble, theory)
            else:  # no steady state: the cool-down has fewer W passes than it would need
                assert theory <= bubble < theoretical_bubble(p, m), (m, bubble)
            one_f_one_b, spans = simulate(build_schedule("1f1b", p, m), t_f, t_b + t_w)
            assert makespan < one_f_one_b
    assert zb_h1_bubble(4, 8) == pytest.approx(3 / 27) and theoretical_bubble(4, 8) == pytest.approx(3 / 11)


# ---- equivalence with one process (multi-process) -----------------------------------------------


def _reference(cfg, tokens, targets, seed):
    from shardwise.model import Transformer

    model = Transformer(cfg)
    model.reset_parameters(seed)
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters_for_init()}


def _check_case(pp: int, dp: int, schedule: str, m: int, v: int, n_layers: int, method: str) -> dict:
    """One pipeline run on ranks laid out (pp, dp) against the single-process reference."""
    cfg = _cfg(n_layers)
    seed, batch = 11 + m, 2 * m * dp
    gen = torch.Generator().manual_seed(1000 + m)
    tokens = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=gen)
    ref_loss, ref_grads = _reference(cfg, tokens, targets, seed)

    dims = ParallelDims(pp=pp, dp=dp)
    coords = dims.coords(dist.get_rank())
    stage_ranks = next(g for g in dims.groups("pp") if dist.get_rank() in g)
    dp_groups = [dist.new_group(g) for g in dims.groups("dp")] if dp > 1 else []
    pp_groups = [dist.new_group(g) for g in dims.groups("pp")] if dp > 1 else [None]
    r, n_stages = coords["pp"], pp * v
    split = partition(cfg, n_stages, method)
    chunks = [build_stage(cfg, c * pp + r, n_stages, split[c * pp + r], seed=seed) for c in range(v)]
    pipe = Pipeline(chunks, stage_ranks, schedule, m, d_model=cfg.d_model)
    local = slice(coords["dp"] * batch // dp, (coords["dp"] + 1) * batch // dp)
    loss = pipe.step(tokens[local], targets[local])
    if dp > 1:  # data parallel: one all-reduce of every gradient, after the last micro-batch
        group = dp_groups[next(i for i, g in enumerate(dims.groups("dp")) if dist.get_rank() in g)]
        for t in pipe.parameters():
            dist.all_reduce(t.grad, group=group)
            t.grad /= dp
        if loss is not None:
            dist.all_reduce(loss, group=group)
            loss /= dp
    worst = 0.0
    if loss is not None:
        torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=RTOL)
    for chunk in chunks:
        for name, t in chunk.named_parameters():
            torch.testing.assert_close(t.grad, ref_grads[name], atol=ATOL, rtol=RTOL, msg=lambda s, n=name: f"{n}: {s}")
            worst = max(worst, (t.grad - ref_grads[name]).abs().max().item())
    # the global gradient norm across stages (tied embedding counted once) equals the reference's
    pp_group = pp_groups[next(i for i, g in enumerate(dims.groups("pp")) if dist.get_rank() in g)]
    ref_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref_grads.values())).float()
    torch.testing.assert_close(global_grad_norm(pipe, pp_group), ref_norm, atol=ATOL, rtol=RTOL)
    return {"case": (pp, dp, schedule, m, v), "max_grad_diff": worst, "peak_live": pipe.timeline.peak_live}


def _run_cases(cases: list[tuple]) -> list[dict]:
    return [_check_case(*case) for case in cases]


def _zb_against_1f1b(pp: int, m: int, recompute: bool, autocast: bool) -> dict:
    """ZB-H1 and 1F1B on the same stages and micro-batches (pp ranks, dp=1): the same loss, every
    nn.Linear gradient bit-equal, the rest within ATOL; ZB-H1 keeps <= p micro-batches live."""
    from torch import nn

    from shardwise.parallel.recompute import checkpoint_module

    cfg, seed = _cfg(4), 5
    gen = torch.Generator().manual_seed(77)
    tokens = torch.randint(0, cfg.vocab_size, (2 * m, SEQ), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2 * m, SEQ), generator=gen)
    r, stage_ranks = dist.get_rank(), list(range(pp))
    split = partition(cfg, pp, "even")
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else None
    runs = {}
    for schedule in ("1f1b", "zb-h1"):
        chunk = build_stage(cfg, r, pp, split[r], seed=seed)
        if recompute:
            for block in chunk.blocks.values():
                checkpoint_module(block)
        kwargs = {"forward_context": context} if context else {}
        pipe = Pipeline([chunk], stage_ranks, schedule, m, d_model=cfg.d_model, **kwargs)
        runs[schedule] = (pipe.step(tokens, targets), chunk, pipe)
    (loss_ref, ref, _), (loss, chunk, pipe) = runs["1f1b"], runs["zb-h1"]
    if loss is not None:
        assert torch.equal(loss, loss_ref)
    linear = {id(t) for mod in chunk.modules() if isinstance(mod, nn.Linear) for t in mod.parameters()}
    assert linear and pipe.weight_grads.pending() == 0
    tied = getattr(chunk, "tied_weight", None)
    for (name, a), b in zip(ref.named_parameters(), chunk.parameters(), strict=True):
        if id(b) in linear and b is not tied:  # the tied table also gets the embedding's gradient in B
            assert torch.equal(a.grad, b.grad), name
        torch.testing.assert_close(b.grad, a.grad, atol=ATOL, rtol=RTOL, msg=lambda s, n=name: f"{n}: {s}")
    assert pipe.timeline.peak_live <= pp
    return {"case": (pp, m, recompute, autocast), "peak_live": pipe.timeline.peak_live}


def _run_zb_cases(cases: list[tuple], zb_cases: list[tuple]) -> list[dict]:
    return [_check_case(*case) for case in cases] + [_zb_against_1f1b(*case) for case in zb_cases]


def test_pp2_every_schedule_equals_one_process():
    cases = [(2, 1, s, m, v, 4, "even") for s, m, v in _cases(2)]
    cases.append((2, 1, "1f1b", 2, 1, 4, "params"))  # a cost-balanced split too
    results = run_on_ranks(2, _run_cases, cases)
    assert len(results[0]) == len(cases)


def test_pp4_every_schedule_and_pp2_dp2_equal_one_process():
    cases = [(4, 1, s, m, v, 8 if v > 1 else 4, "even") for s, m, v in _cases(4)]
    cases += [(2, 2, s, m, 1, 4, "even") for s, m in (("gpipe", 3), ("1f1b", 2))]
    cases.append((2, 2, "interleaved", 4, 2, 4, "even"))
    results = run_on_ranks(4, _run_cases, cases)
    assert len(results[0]) == len(cases)


def test_zb_h1_pp2_equals_one_process():
    cases = [(2, 1, "zb-h1", m, 1, 4, "even") for m in (1, 2, 5)]
    zb_cases = [(2, 4, recompute, autocast) for recompute in (False, True) for autocast in (False, True)]
    results = run_on_ranks(2, _run_zb_cases, cases, zb_cases)
    assert [r["peak_live"] for r in results[0]] == [1, 2, 2, 2, 2, 2, 2]  # rank 0: min(p, m)


def test_zb_h1_pp4_and_pp2_dp2_equal_one_process():
    cases = [(4, 1, "zb-h1", m, 1, 4, "even") for m in (3, 4, 9)] + [(2, 2, "zb-h1", 4, 1, 4, "params")]
    zb_cases = [(4, 9, True, True)]
    results = run_on_ranks(4, _run_zb_cases, cases, zb_cases)
    assert all(r["peak_live"] <= 4 for per_rank in results for r in per_rank)
