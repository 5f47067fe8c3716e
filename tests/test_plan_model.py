"""The planner's arithmetic agrees with the model code and the trainer's config resolution."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.model.transformer import Transformer
from shardwise.plan.flops import flops_per_token, matmul_params
from shardwise.plan.params import count_params
from shardwise.plan.spec import Layout, model_config_of, model_spec
from shardwise.train.flops import GPU_PEAK_FLOPS, training_flops_per_token


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "cpu-demo", "gpt2-124m", "llama-1b"])
def test_param_count_equals_transformer(preset):
    cfg = Config.load(overrides={"model.preset": preset})
    spec = model_spec(cfg)
    with torch.device("meta"):
        model = Transformer(model_config_of(spec))
    counts = count_params(spec)
    assert counts.total == model.num_parameters()
    assert counts.non_embedding == model.num_parameters(exclude_embeddings=True)
    # the planner resolves the model as the trainer does
    trainer = resolve(cfg, world_size=1, tokenizer_vocab=257).model
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len", "tie_embeddings"):
        assert getattr(spec, key) == getattr(trainer, key), key


def test_planner_accepts_layouts_the_trainer_rejects():
    cfg = Config.load(overrides={"model.preset": "gpt3-175b", "parallel.tp": "8", "parallel.pp": "8",
                                 "ps.servers": "1"})
    with pytest.raises(ConfigError):
        resolve(cfg, world_size=64)
    assert model_spec(cfg).n_layers == 96


def test_moe_counts():
    cfg = Config.load(overrides={"model.preset": "tiny-llama"})
    dense = count_params(model_spec(cfg))
    moe = count_params(model_spec(cfg, n_experts=8, moe_top_k=2))
    assert moe.mlp == 8 * dense.mlp and moe.mlp_active == 2 * dense.mlp
    assert moe.router == 2 * 64 * 8
    assert moe.active == dense.total + dense.mlp + moe.router
    assert flops_per_token(model_spec(cfg, 8, 2), 64) > flops_per_token(model_spec(cfg), 64)


@pytest.mark.parametrize("preset", ["cpu-demo", "tiny-llama"])
def test_trainer_flops_come_from_the_planner(preset):
    cfg = resolve(Config.load(overrides={"model.preset": preset}), world_size=1, tokenizer_vocab=257)
    spec = model_spec(cfg)
    fpt = training_flops_per_token(cfg.model, cfg.data.seq_len)
    assert fpt == flops_per_token(spec, cfg.data.seq_len)
    m = cfg.model
    # PaLM App. B: 6 (non-embedding + V d) + 12 L d T, with the head counted once even when untied
    c = count_params(spec)
    assert matmul_params(spec) == c.total - c.embedding - c.position - c.head + m.vocab_size * m.d_model
    assert fpt == 6 * matmul_params(spec) + 12 * m.n_layers * m.d_model * cfg.data.seq_len
    assert GPU_PEAK_FLOPS["A100"]["bf16"] == 312e12


def test_recompute_conventions():
    spec = model_spec(Config.load(overrides={"model.preset": "gpt2-124m"}))
    model = flops_per_token(spec, 1024, "full", "model")
    hw_full = flops_per_token(spec, 1024, "full", "hardware")
    hw_sel = flops_per_token(spec, 1024, "selective", "hardware")
    assert model == flops_per_token(spec, 1024)
    assert model < hw_sel < hw_full < model * 4 / 3 + 1
    assert Layout(dp=2, micro_batch=3, grad_accum=4).global_batch == 24


PLANNER_MAY_IMPORT = ("shardwise.plan", "shardwise.config", "shardwise.config_resolve", "shardwise.checks",
                      "shardwise.lazy", "shardwise.dist.comm.cost", "shardwise.train.metrics",
                      "shardwise.parallel.pipeline.checks", "shardwise.parallel.expert.checks")
"""What the planner's modules may import from the project: its own package, the config tree, the alpha-beta
cost model of the collectives (formulas, shared with comm.algorithm='auto'), the reader of a run's
metrics.jsonl (what --compare sets beside the prediction), and the pipeline's and the experts' config rules
(functions of the config alone: which pipeline splits are valid and how the even split places the blocks, which
ep divides the layout -- one rule for the trainer, the planner and the simulator). No model, technique or engine
code."""
SIMULATOR_MAY_BE_CALLED_BY = ("cli.py", "compare.py")
"""The simulator (shardwise.sim) runs the engine's own schedules by design; the plan's command line calls it to
re-rank layouts (--simulate-top) and to set a simulated step beside the formula's and the run's (--compare): a
third, separate estimate. No other planner module may reach it, so none of the formulas can."""


def test_the_planner_imports_no_engine_code():
    """Every import in src/shardwise/plan, function-level ones too: the predictions come from the model
    shape, the layout and the papers, so ``plan --compare`` holds two independent things together."""
    import ast
    from pathlib import Path

    import shardwise.plan

    for path in sorted(Path(shardwise.plan.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                if name.startswith("shardwise.sim") and path.name in SIMULATOR_MAY_BE_CALLED_BY:
                    continue
                if name.startswith("shardwise"):
                    assert name.startswith(PLANNER_MAY_IMPORT), f"{path.name} imports {name}"


@pytest.mark.parametrize("overrides", [
    {"model.preset": "tiny"}, {"model.preset": "tiny-llama"}, {"model.preset": "cpu-demo"},
    {"model.preset": "tiny", "model.tie_embeddings": "false"}, {"model.preset": "tiny-moe", "model.moe_shared": "2"},
    {"model.preset": "tiny-llama", "model.n_experts": "4", "model.moe_shared": "1", "model.moe_every": "2"},
])
def test_the_planners_tensors_are_the_models(overrides):
    """The tensors the planner derives from the shape (names, sizes, order) are the trainer's model's,
    derived independently: where ZeRO pads per unit and buckets close at tensor boundaries, both agree."""
    from shardwise.plan.tensors import model_params

    cfg = resolve(Config.load(overrides=overrides), world_size=1, tokenizer_vocab=257)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    assert [(e.name, e.numel) for e in model_params(model_spec(cfg))] == \
        [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]


def test_where_the_planners_assumptions_differ_from_the_trainer():
    """Stated, and shown: the planner counts BERT as GPT-2 (the model has a token-type table, an embedding
    norm, the MLM transform and an output bias besides), and splits pipeline stages evenly, where the
    trainer's default pp_partition='params' balances parameters (3 blocks of the tiny model on 2 stages:
    the embedding's weight moves a block to the second stage)."""
    from shardwise.parallel.pipeline.partition import partition
    from shardwise.plan.tensors import even_stage_blocks, model_params

    bert = resolve(Config.load(overrides={"model.preset": "custom", "model.flavor": "bert", "model.n_layers": "2",
                                          "model.d_model": "32", "model.n_heads": "4", "model.max_seq_len": "32",
                                          "train.objective": "mlm"}), world_size=1, tokenizer_vocab=257)
    with torch.device("meta"):
        model = Transformer(bert.model)
    planned = {e.name for e in model_params(model_spec(bert))}
    assert sorted(n for n, _ in model.named_parameters() if n not in planned) == [
        "emb_norm.bias", "emb_norm.weight", "lm_head.bias", "mlm_dense.bias", "mlm_dense.weight", "type_emb.weight"]
    tiny = resolve(Config.load(overrides={"model.preset": "tiny", "model.n_layers": "3"}), world_size=1,
                   tokenizer_vocab=257)
    assert [list(r) for r in even_stage_blocks(3, 2)] == [[0, 1], [2]]
    assert [list(r) for r in partition(tiny.model, 2, "params")] == [[0], [1, 2]]
    assert [list(r) for r in partition(tiny.model, 2, "even")] == [[0, 1], [2]]
