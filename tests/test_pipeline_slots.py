"""The embedding's and the head's own places in the pipeline's even split (``parallel.pp_embedding_slot`` /
``pp_head_slot``; Megatron-LM's account-for-embedding / account-for-loss, Llama 3 §3.3.2): one rule for the
trainer, the planner and the simulator, and a pipeline whose first chunk is the embedding alone and whose last
is the head alone trains the same model as one process."""

from __future__ import annotations

import pytest

from shardwise.config import ConfigError
from shardwise.parallel.pipeline.checks import check_stages, even_stage_sizes
from shardwise.parallel.pipeline.partition import config_split, even_split
from tests.test_train import assert_same_training, run


def test_even_split_with_slots():
    assert even_stage_sizes(126, 16) == [8] * 14 + [7] * 2
    assert even_stage_sizes(126, 16, True, True) == [7] + [8] * 14 + [7]  # 128 places, 8 a stage
    assert even_stage_sizes(127, 16, embedding_slot=True) == [7] + [8] * 15
    assert even_stage_sizes(2, 4, True, True) == [0, 1, 1, 0]  # Llama 3: the embedding alone, the head alone
    assert even_split(2, 4, True, True) == [range(0, 0), range(0, 1), range(1, 2), range(2, 2)]
    assert sum(even_stage_sizes(37, 5, True, False)) == 37


def test_the_fields_move_blocks_in_the_engines_and_the_simulators_split():
    """The engine and the simulator both cut by :func:`config_split`; each slot moves one block off its stage."""
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.sim.hardware import build_hardware
    from shardwise.sim.simulate import load_config, simulate

    def split(layers, **slots):
        over = {"parallel.nproc": "2", "parallel.pp": "2", "model.preset": "tiny", "model.n_layers": str(layers),
                "parallel.pp_partition": "even", **{f"parallel.pp_{k}_slot": "true" for k in slots}}
        return config_split(resolve(Config.load(overrides=over), tokenizer_vocab=257))

    assert split(5) == [range(0, 3), range(3, 5)] and split(5, embedding=1) == [range(0, 2), range(2, 5)]
    assert split(4) == [range(0, 2), range(2, 4)] and split(4, head=1) == [range(0, 3), range(3, 4)]
    hw = build_hardware("H100", 1, 2)
    over = {"model.preset": "tiny", "model.n_layers": "5", "parallel.pp": "2", "parallel.pp_partition": "even",
            "parallel.pp_embedding_slot": "true", "train.global_batch": "8"}
    res = simulate(load_config(None, over, hw), hw)
    assert res.builder.split == [range(0, 2), range(2, 5)]


def test_too_many_stages_names_the_real_bound():
    with pytest.raises(ValueError, match=r"pp=64 x parallel.pp_virtual=4 = 256 .* use parallel.pp_virtual <= 2"):
        check_stages(128, 256, pp=64)
    with pytest.raises(ValueError, match=r"126 \+ 2 slot.*use parallel.pp_virtual <= 4"):  # 128 places on pp 32
        check_stages(126, 32 * 5, slots=2, pp=32)
    check_stages(126, 32 * 4, slots=2, pp=32)
    with pytest.raises(ValueError, match=r"use parallel.pp <= 4 with parallel.pp_virtual=1"):
        check_stages(4, 16, pp=8)


def test_planner_accepts_uneven_pipelines_the_trainer_runs():
    """126 layers on pp 16: the trainer and the simulator run it, so the planner must not drop it; its busiest
    stage holds 8 blocks (7 with the head's slot on the last, the embedding's on the first)."""
    from shardwise.plan.hardware import Cluster, find_gpu
    from shardwise.plan.search import check
    from shardwise.plan.spec import Layout, ModelSpec
    from shardwise.plan.tensors import stage_blocks

    m = ModelSpec(flavor="llama", n_layers=126, d_model=1024, n_heads=8, n_kv_heads=8, d_ff=4096, vocab_size=32000,
                  max_seq_len=4096, tie_embeddings=False)
    cluster = Cluster(find_gpu("H100"), gpus_per_node=8, nodes=16)
    lay = Layout(dp=1, tp=8, pp=16, grad_accum=16)
    assert check(m, lay, 4096, cluster) is None
    assert stage_blocks(m, lay) == 8
    assert check(m, Layout(dp=1, tp=8, pp=16, pp_virtual=8, grad_accum=16), 4096, cluster) is not None
    slotted = Layout(dp=1, tp=8, pp=16, grad_accum=16, pp_embedding_slot=True, pp_head_slot=True)
    assert stage_blocks(m, slotted) == 8 and stage_blocks(m, Layout(pp=16, pp_head_slot=True)) == 8
    assert stage_blocks(m, Layout(pp=8)) == 16


def test_slots_are_refused_where_they_would_do_nothing(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match=r"parallel.pp_embedding_slot=true gives the embedding .*"
                                          r"pp_partition='params'"):
        run(tmp_path, cache_dir, "x", 2, **{"parallel.pp": 2, "parallel.pp_embedding_slot": "true"})
    with pytest.raises(ConfigError, match=r"parallel.pp_head_slot=true .* parallel.pp=1"):
        run(tmp_path, cache_dir, "y", 1, **{"parallel.pp_head_slot": "true"})


def test_embedding_and_head_alone_in_their_chunks_train_like_one_process(tmp_path, cache_dir):
    """pp 2 x 2 chunks over 2 layers with both slots: rank 0 runs [embedding] and [block 1], rank 1 [block 0] and
    [head] -- losses, pre-clip gradient norms and weights as one process."""
    common = {"model.n_layers": 2, "train.steps": 2}
    ref = run(tmp_path, cache_dir, "ref", 1, **common, **{"train.grad_accum": 4})
    pp = run(tmp_path, cache_dir, "pp", 2, **common, **{
        "parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2,
        "parallel.microbatches": 4, "parallel.pp_partition": "even", "parallel.pp_embedding_slot": "true",
        "parallel.pp_head_slot": "true"})
    assert_same_training(pp, ref, atol=1e-5)
