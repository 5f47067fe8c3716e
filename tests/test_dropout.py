"""Dropout that does not depend on the layout (shardwise.model.dropout, shardwise.parallel.dropout).

* the generator is Philox4x32-10: Random123's known-answer vectors;
* a mask drawn for any slice of a site's tensor is that slice of the whole mask, and drops p of it;
* under tp 4 x cp 2 (sequence parallel) x pp 2 every rank's masks -- the embedding's, the residual
  branches', the attention probabilities' blocks of ring and Ulysses attention -- are its slice of the one
  process's masks, element for element, the ranks together draw every element one process draws, and no
  rank allocates more than its own slice while drawing;
* training with model.dropout 0.1 under tp 2, tp 2 + SP, cp 2 (ring, all-gather, Ulysses), pp 2, ep 2 and
  recompute full / selective equals one process (GPT-2, Llama, tiny-moe; losses, pre-clip gradient norms
  and weights within 1e-5; 6 steps, clipping off so a scaled gradient cannot hide).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.model.dropout import Dropout, DropoutKey, keep_mask, threshold
from shardwise.model.philox import philox4x32, philox4x32_traced
from tests.test_train import assert_same_training, run

KAT = [  # Random123 tests/kat_vectors, philox4x32 10: counter, key, output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_matches_the_random123_known_answers():
    for counter, key, expected in KAT:
        assert [int(w) for w in philox4x32(tuple(torch.tensor([c]) for c in counter), key)] == list(expected)
        words = [torch.tensor([c]) for c in counter]  # the compiler's form, the key as int or as tensors
        assert [int(w) for w in philox4x32_traced(words, key)] == list(expected)
        assert [int(w) for w in philox4x32_traced(words, tuple(torch.tensor(k) for k in key))] == list(expected)
    # vectorised: a lane's words do not depend on its neighbours (all-zero counter beside the all-ones one)
    lanes = tuple(torch.tensor([a, b]) for a, b in zip(KAT[0][0], KAT[1][0], strict=True))
    assert [int(w[0]) for w in philox4x32(lanes, KAT[0][1])] == list(KAT[0][2])


def test_a_slice_of_the_mask_is_the_mask_of_the_slice():
    key = DropoutKey(seed=3, step=7, first_sequence=5)
    full = keep_mask(0.1, key, 2, "attn_probs", [torch.arange(5, 8), torch.arange(4), torch.arange(48),
                                                  torch.arange(48)], [4, 48, 48])
    assert abs((~full).float().mean().item() - threshold(0.1) / 65536) < 0.01
    # aligned pieces (whole runs of 8 along the last axis) and unaligned ones (each element its own call)
    for rows, heads, queries, keys in [([1], [2, 3], range(8, 24), range(16, 40)), ([0, 2], [3, 0], [5, 1, 40],
                                                                                   [47, 3, 9, 10, 11])]:
        index = [torch.tensor(rows) + 5, torch.tensor(heads), torch.tensor(list(queries)), torch.tensor(list(keys))]
        piece = keep_mask(0.1, key, 2, "attn_probs", index, [4, 48, 48])
        expected = full[torch.tensor(rows)][:, torch.tensor(heads)][:, :, index[2]][..., index[3]]
        assert torch.equal(piece, expected)
    other = keep_mask(0.1, key, 3, "attn_probs", [torch.arange(5, 8), torch.arange(4), torch.arange(48),
                                                   torch.arange(48)], [4, 48, 48])
    assert not torch.equal(other, full), "another layer draws another mask"


class LargestAllocation(TorchDispatchMode):
    """The largest storage any op creates while active (a view's storage is its base's, counted once)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t._base is None:
                self.bytes = max(self.bytes, t.untyped_storage().nbytes())
        return out


class FakeMesh:
    """The sizes and this rank's coordinates of a mesh, without processes (all place_dropout reads)."""

    def __init__(self, **axes: tuple[int, int]):
        self.axes = axes

    def size(self, axis: str) -> int:
        return self.axes.get(axis, (1, 0))[0]

    def rank(self, axis: str) -> int:
        return self.axes.get(axis, (1, 0))[1]


def attention_pieces(algorithm: str, core, drop, batch: int, t: int, heads_here: int):
    """``(draw, global heads, query positions, key positions)`` of every piece of an attention-probability mask
    a context-parallel rank draws: the ring's blocks (all-gather draws the same), or Ulysses' heads."""
    from shardwise.parallel.context.blocks import block_pair
    from shardwise.parallel.context.ring import block_keep
    from shardwise.parallel.context.ulysses import ulysses_keep

    layout, cp = core.layout, core.size
    if algorithm == "ulysses":
        per = heads_here // cp
        every = torch.arange(cp * t)
        return [(functools.partial(ulysses_keep, core, drop, batch, heads_here, t),
                 drop.heads.index[core.rank * per:(core.rank + 1) * per], every, every)]
    pieces = []
    for src in range(cp):
        pair = block_pair(core.rank, src, t, layout.balance)
        pieces.append((functools.partial(block_keep, core, drop, batch, t, src, pair), drop.heads.index,
                       layout.positions(t)[pair.q], layout.positions(t, rank=src)[pair.kv]))
    return pieces


@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
def test_masks_under_tp4_cp2_pp2_are_the_one_process_masks_and_no_rank_allocates_more_than_its_slice(algorithm):
    """Every rank of tp 4 x cp 2 x pp 2 (sequence parallel), simulated in this process by the placement the
    engine applies (place_dropout on each pipeline stage, the cp cores' own drawing functions)."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer
    from shardwise.parallel.context.core import ContextAttention
    from shardwise.parallel.context.layout import SequenceLayout
    from shardwise.parallel.dropout import place_dropout
    from shardwise.parallel.pipeline.partition import build_stage, even_split

    tp, cp, pp = 4, 2, 2
    cfg = resolve(Config.load(overrides={
        "model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": "2", "model.d_model": "64",
        "model.n_heads": "8", "model.max_seq_len": "64", "model.dropout": "0.1", "data.seq_len": "64",
        "parallel.nproc": str(tp * cp), "parallel.tp": str(tp), "parallel.cp": str(cp),
        "parallel.sequence_parallel": "true", "parallel.cp_algorithm": algorithm}),
        tokenizer_vocab=256)  # the pipeline stages: built below, as the engine builds them
    m, b, t_all = cfg.model, 2, cfg.data.seq_len
    key = DropoutKey(seed=1, step=4, first_sequence=6)
    one = Transformer(m).train()  # one process: every site's whole mask
    x_all = torch.ones(b, t_all, m.d_model)
    positions = torch.arange(t_all)
    whole = {("embed", -1): one.drop(x_all, key) != 0}
    for blk in one.blocks:
        whole[("attn_out", blk.layer_id)] = blk.drop_attn(x_all, key) != 0
        whole[("mlp_out", blk.layer_id)] = blk.drop_mlp(x_all, key) != 0
        drop = blk.attn.dropout_of(key, m.n_heads, None)
        whole[("attn_probs", blk.layer_id)] = drop.keep(b, positions, positions, t_all, causal=True)
    drawn = {site: torch.zeros(mask.shape, dtype=torch.int64) for site, mask in whole.items()}
    split = even_split(m.n_layers, pp)
    for stage_id in range(pp):
        stage = build_stage(m, stage_id, pp, split[stage_id]).train()
        for cp_rank in range(cp):
            core = ContextAttention(algorithm, SequenceLayout(cp, cp_rank, cfg.parallel.cp_balance), None,
                                    list(range(cp)))
            for tp_rank in range(tp):
                place_dropout(stage, FakeMesh(tp=(tp, tp_rank), cp=(cp, cp_rank)), cfg)
                for module in stage.modules():
                    if isinstance(module, Dropout):  # the residual stream: this rank's tokens, every feature
                        tokens = module.tokens.index
                        x = torch.ones(b, len(tokens), m.d_model)
                        with LargestAllocation() as probe:
                            mine = module(x, key) != 0
                        assert probe.bytes <= x.numel() * x.element_size(), (module, probe.bytes)
                        assert torch.equal(mine, whole[(module.site, module.layer)][:, tokens])
                        drawn[(module.site, module.layer)][:, tokens] += 1
                for blk in stage.blocks.values():  # the attention probabilities: this rank's heads and blocks
                    heads_here = m.n_heads // tp
                    drop = blk.attn.dropout_of(key, heads_here, None)
                    ref, count = whole[("attn_probs", blk.layer_id)], drawn[("attn_probs", blk.layer_id)]
                    for draw, heads, rows, cols in attention_pieces(algorithm, core, drop, b, t_all // cp, heads_here):
                        with LargestAllocation() as probe:
                            mine = draw()
                        assert probe.bytes <= mine.numel(), "more than one byte per element of its slice"
                        assert torch.equal(mine, ref[:, heads][:, :, rows][..., cols])
                        count[:, heads[:, None, None], rows[None, :, None], cols[None, None, :]] += 1
    for (site, _layer), count in drawn.items():
        if site != "attn_probs":  # sequence parallel inside context parallel: each token on exactly one rank
            assert torch.equal(count, torch.ones_like(count)), site
        else:  # every element causal attention reads (query >= key) on exactly one rank; none on two
            needed = torch.ones(t_all, t_all, dtype=torch.bool).tril()
            assert bool(((count > 0) | ~needed).all()) and count.max() == 1


DROPOUT = {"model.dropout": 0.1, "train.steps": 6, "train.grad_clip": 0}
"""Every run: dropout 0.1, 6 steps, no clipping (a wrongly scaled gradient shows in the norms and weights)."""
LLAMA = {"model.preset": "tiny-llama"}


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache_dir):
    """One single-process run per model, computed when first asked for."""
    done = {}

    def get(name: str, **overrides):
        if name not in done:
            done[name] = run(tmp_path_factory.mktemp(f"ref-{name}"), cache_dir, "one", 1, **DROPOUT, **overrides)
        return done[name]

    return get


@pytest.mark.parametrize("name,model,nproc,overrides", [
    ("tp2", {}, 2, {"parallel.tp": 2}),
    ("tp2-sp-selective", LLAMA, 2, {"parallel.tp": 2, "parallel.sequence_parallel": True,
                                    "train.recompute": "selective"}),
    ("ring2", {}, 2, {"parallel.cp": 2}),
    ("allgather2-full", LLAMA, 2, {"parallel.cp": 2, "parallel.cp_algorithm": "allgather",
                                   "train.recompute": "full"}),
    ("ulysses2-tp2-sp", LLAMA, 4, {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses", "parallel.tp": 2,
                                   "parallel.sequence_parallel": True}),
    ("pp2-dp2", {}, 4, {"parallel.pp": 2, "parallel.microbatches": 2, "train.micro_batch": 2}),
    ("recompute-full", {}, 1, {"train.recompute": "full", "train.micro_batch": 4}),
    ("ep2", {"model.preset": "tiny-moe", "train.micro_batch": 4}, 2, {"parallel.ep": 2}),  # aux loss per 4
])
def test_dropout_trains_what_one_process_trains(references, tmp_path, cache_dir, name, model, nproc, overrides):
    ref = references(model.get("model.preset", "tiny"), **model)
    assert_same_training(run(tmp_path, cache_dir, name, nproc, **DROPOUT, **model, **overrides), ref, atol=1e-5)


def test_without_dropout_one_process_trains_another_model(references, tmp_path, cache_dir):
    """The references above do drop: the same run with model.dropout 0 has other losses."""
    plain = run(tmp_path, cache_dir, "plain", 1, **{**DROPOUT, "model.dropout": 0.0})
    assert min(abs(a - b) for a, b in zip(plain[0][1:], references("tiny")[0][1:], strict=True)) > 1e-3


def test_the_fused_mask_compiles_once_per_shape_for_every_key_with_the_eager_bits():
    """What a GPU draws (MaskPlan.fused): the whole-tensor plan compiled ``fullgraph`` (no graph break, so no host
    read and no data-dependent shape) by TorchInductor -- here its CPU code -- gives the eager masks' bits for keys
    and layers that change every call, from at most two graphs per shape (the first key's constants, then the key
    symbolic: it enters as tensors, where an int key made symbolic does not build), with no eager fallback."""
    from torch._dynamo.utils import counters

    from shardwise.model.dropout import LANES, MaskPlan, _FusedDraw

    torch._dynamo.reset()
    counters.clear()
    fused, plan = _FusedDraw(), MaskPlan(None, False, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the fallback warns
        for step, t in ((1, 32), (2, 32), (3, 32), (4, 48), (5, 48)):
            key = DropoutKey(seed=11, step=step, first_sequence=3 * step)
            pos = torch.arange(t)
            index, extents = [torch.arange(2), torch.arange(2), pos, pos], [2, t, t]
            eager = keep_mask(0.1, key, step, "attn_probs", index, extents, True, aligned=t % LANES == 0)
            assert torch.equal(fused(0.1, key, step, "attn_probs", index, extents, True, True, plan), eager), step
    assert fused.failed is None and counters["stats"]["unique_graphs"] <= 4


def test_the_fused_mask_keeps_every_site_and_shape_compiled():
    """A model's sites and shapes each get their graphs (a bert classifier's five sites, two lengths, two keys: 20
    graphs, past TorchDynamo's default limit of 8, where ``fullgraph`` would fail and every later mask fall back to
    the eager draw), with the eager bits. Traced by the "eager" backend: the limit is TorchDynamo's, whatever
    compiles the graphs."""
    from torch._dynamo.utils import counters

    from shardwise.model.dropout import LANES, SITES, MaskPlan, _FusedDraw

    torch._dynamo.reset()
    counters.clear()
    fused, plan = _FusedDraw(backend="eager"), MaskPlan(None, False, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the fallback warns
        for step, t in ((1, 16), (2, 16), (3, 24), (4, 24)):
            key = DropoutKey(seed=5, step=step, first_sequence=step)
            pos = torch.arange(t)
            for site in SITES:
                if site == "attn_probs":
                    index, extents, causal = [torch.arange(2), torch.arange(2), pos, pos], [2, t, t], True
                elif site == "classifier":
                    index, extents, causal = [torch.arange(2), torch.arange(t)], [t], False
                else:
                    index, extents, causal = [torch.arange(2), pos, torch.arange(16)], [t, 16], False
                aligned = extents[-1] % LANES == 0 and len(index[-1]) % LANES == 0
                eager = keep_mask(0.1, key, 1, site, index, extents, causal, aligned=aligned)
                got = fused(0.1, key, 1, site, index, extents, causal, aligned, plan)
                assert torch.equal(got, eager), (step, site)
    assert fused.failed is None and counters["stats"]["unique_graphs"] > 8
