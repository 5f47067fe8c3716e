"""The bert flavour in the trainer: masked-LM on data parallel, ZeRO-3, pp 2 and tp 2, and -- with dropout 0.1
and clipping off -- tp 2 + sequence parallelism and cp 2 (every algorithm, bidirectional); classification on
data parallel, ZeRO-2, tp 2 and (with dropout) pp 2; each on 2 ranks trains the same model as one process
(fp32, 1e-5); the masking is 15 % / 80-10-10 and the same for every layout; what is not implemented is
refused with one line."""

from __future__ import annotations

import torch

from shardwise.data.mlm import mask_window
from tests.test_train import assert_same_training, run

BERT = {"model.preset": "custom", "model.flavor": "bert", "model.n_layers": 2, "model.d_model": 64,
        "model.n_heads": 4, "model.max_seq_len": 32, "train.objective": "mlm", "train.micro_batch": 4,
        "train.lr": 1e-3, "train.steps": 6}
"""micro-batches of 4 windows everywhere: the step's loss is the mean of per-micro-batch means (their
masked-token counts differ), so one process accumulates 2 micro-batches where 2 ranks take one each."""


def test_masking_is_15_percent_80_10_10():
    tokens = torch.randint(0, 257, (200_000,), generator=torch.Generator().manual_seed(0))
    inputs, targets = mask_window(tokens, seed=1, index=7, mask_id=257, n_random=257)
    chosen = targets != -100
    assert abs(chosen.float().mean().item() - 0.15) < 0.005
    assert torch.equal(targets[chosen], tokens[chosen]) and torch.equal(inputs[~chosen], tokens[~chosen])
    masked = (inputs[chosen] == 257).float().mean().item()
    kept = (inputs[chosen] == tokens[chosen]).float().mean().item()
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1 - 0.1 / 257) < 0.01
    again = mask_window(tokens, seed=1, index=7, mask_id=257, n_random=257)
    assert torch.equal(again[0], inputs), "seeded by (seed, window) alone"


def test_mlm_on_data_parallel_zero3_pipeline_and_tensor_parallel_equals_one_process(tmp_path, cache_dir):
    single = run(tmp_path, cache_dir, "bert1", 1, **BERT)
    assert single[0][-1] < single[0][0], f"the loss should fall: {single[0]}"
    assert_same_training(run(tmp_path, cache_dir, "bert-dp2", 2, **BERT), single, atol=1e-5)
    assert_same_training(run(tmp_path, cache_dir, "bert-zero3", 2, **BERT, **{"parallel.zero": 3}), single, atol=1e-5)
    assert_same_training(run(tmp_path, cache_dir, "bert-pp2", 2, **BERT, **{"parallel.pp": 2}), single, atol=1e-5)
    assert_same_training(run(tmp_path, cache_dir, "bert-tp2", 2, **BERT, **{"parallel.tp": 2}), single, atol=1e-5)


DROPOUT = {"model.dropout": 0.1, "train.grad_clip": 0}


def test_mlm_with_sequence_and_context_parallelism_equals_one_process(tmp_path, cache_dir):
    """Token types looked up for the rank's tokens under sequence parallelism; bidirectional context-parallel
    cores (every block of keys seen whole) with dropout on their probabilities; the embedding, residual and
    attention masks those of one process."""
    single = run(tmp_path, cache_dir, "bert1", 1, **BERT, **DROPOUT)
    for name, overrides in [("tp2-sp", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
                            ("ring2", {"parallel.cp": 2}),
                            ("allgather2", {"parallel.cp": 2, "parallel.cp_algorithm": "allgather"}),
                            ("ulysses2", {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"})]:
        assert_same_training(run(tmp_path, cache_dir, name, 2, **BERT, **DROPOUT, **overrides), single, atol=1e-5)


def test_bert_configs_that_are_not_implemented_are_refused_with_one_line():
    import pytest

    from shardwise import config_resolve
    from shardwise.config import Config, ConfigError

    def resolve(**overrides):
        base = {"parallel.nproc": "2", "model.flavor": "bert", "train.objective": "mlm"}
        overrides = {**base, **{k.replace("_", ".", 1): str(v) for k, v in overrides.items()}}
        return config_resolve.resolve(Config.load(overrides=overrides), tokenizer_vocab=257)

    assert resolve().model.vocab_size == 260, "[PAD], [CLS], [MASK] past the tokenizer's ids"
    for overrides, message in [
        ({"train_objective": "classify"}, "model.n_classes=0: train.objective='classify' needs the number"),
        ({"train_objective": "classify", "model_n_classes": 2}, "reads a label per document from a jsonl or parquet"),
        ({"train_objective": "causal"}, "model.flavor='bert' is a bidirectional encoder"),
        ({"parallel_tp": 2, "parallel_sequence_parallel": "true", "train_objective": "classify", "model_n_classes": 2,
          "data_source": __file__, "data_format": "jsonl"},
         "parallel.sequence_parallel=true with train.objective='classify': the classifier reads the [CLS] token"),
        ({"parallel_cp": 2, "train_objective": "classify", "model_n_classes": 2, "data_source": __file__,
          "data_format": "jsonl"}, "parallel.cp=2 with train.objective='classify': the classifier reads"),
        ({"model_vocab_size": 259}, "model.vocab_size=259 leaves no ids for bert's [PAD], [CLS] and [MASK]"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            resolve(**overrides)


def labelled_jsonl(path, n: int = 160):
    """Documents of random words; label 1 when the word "needle" occurs."""
    import json
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]
    lines = []
    for _ in range(n):
        text = [rng.choice(words) for _ in range(rng.randint(2, 5))]
        label = rng.random() < 0.5
        if label:
            text.insert(rng.randint(0, len(text)), "needle")
        lines.append(json.dumps({"text": " ".join(text), "label": int(label)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_classify_on_data_parallel_zero2_and_tensor_parallel_equals_one_process(tmp_path, cache_dir):
    data = labelled_jsonl(tmp_path / "docs.jsonl")
    cls = {**BERT, "train.objective": "classify", "model.n_classes": 2, "data.source": str(data),
           "data.val_fraction": 0.2, "data.max_bytes": 0}
    single = run(tmp_path, cache_dir, "cls1", 1, **cls)  # (it learns: see the README; 8 steps are too few)
    assert_same_training(run(tmp_path, cache_dir, "cls-dp2", 2, **cls), single, atol=1e-5)
    assert_same_training(run(tmp_path, cache_dir, "cls-zero2", 2, **cls, **{"parallel.zero": 2}), single, atol=1e-5)
    assert_same_training(run(tmp_path, cache_dir, "cls-tp2", 2, **cls, **{"parallel.tp": 2}), single, atol=1e-5)


def test_classify_in_a_pipeline_equals_one_process(tmp_path, cache_dir):
    """pp 2: every stage masks the [PAD] keys of its micro-batch (from the tokens every pipeline rank reads), the
    last holds the pooler, the classifier and its dropout."""
    data = labelled_jsonl(tmp_path / "docs.jsonl")
    cls = {**BERT, **DROPOUT, "train.objective": "classify", "model.n_classes": 2, "data.source": str(data),
           "data.val_fraction": 0.2, "data.max_bytes": 0}
    single = run(tmp_path, cache_dir, "cls1", 1, **cls)
    pipe = run(tmp_path, cache_dir, "cls-pp2", 2, **cls, **{"parallel.pp": 2, "parallel.microbatches": 2})
    assert_same_training(pipe, single, atol=1e-5)


def test_mlm_with_experts_under_ep_and_sequence_parallelism_equals_one_process(tmp_path, cache_dir):
    """A mixture-of-experts BERT (exact-GELU experts, post-norm blocks): ep 2 and tp 2 + SP (each tp rank routes
    its share of every sequence; the router losses are the whole sequence's) train what one process trains."""
    moe = {**BERT, "model.n_experts": 4, "train.grad_clip": 0}
    single = run(tmp_path, cache_dir, "bert-moe1", 1, **moe)
    assert_same_training(run(tmp_path, cache_dir, "bert-moe-ep2", 2, **moe, **{"parallel.ep": 2}), single, atol=1e-5)
    sp = {"parallel.tp": 2, "parallel.sequence_parallel": True}
    assert_same_training(run(tmp_path, cache_dir, "bert-moe-sp", 2, **moe, **sp), single, atol=1e-5)
