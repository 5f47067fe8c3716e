"""The layout fuzzer (tests/layout_fuzz.py; scripts/fuzz_layouts.py runs campaigns) in the suite: a few random
layouts per run, seeded by the source tree so that every change draws others, each trained against one process;
and the fuzzer's own parts -- every draw is accepted or refused in one line before any worker starts, a failure
shrinks to what causes it and prints as one command. The regression tests of the bugs it found are beside the
code they guard (docs/tests.md names them)."""

from __future__ import annotations

import random

from shardwise import config_resolve
from shardwise.config import Config, ConfigError
from tests import layout_fuzz as fuzz

RAN = 4
"""Draws trained per suite run (refused draws are free: they stop before any worker)."""


def test_random_layouts_train_the_one_process_model(cache_dir):
    seed = fuzz.source_seed()
    print(f"layout fuzzer: source-tree seed {seed}")  # shown with -s or on failure, to replay these draws
    checker = fuzz.Checker(cache_dir)
    rng, outcomes = random.Random(seed), []
    while sum(o.kind != "refused" for o in outcomes) < RAN and len(outcomes) < 30:
        outcomes.append(checker.check(fuzz.draw(rng, max_ranks=4)))
    failed = [o for o in outcomes if o.kind == "failed"]
    assert not failed, "\n".join(fuzz.describe_failure(o) for o in failed) + (
        f"\n(source-tree seed {seed}; these draws again: python scripts/fuzz_layouts.py --n {len(outcomes)} "
        f"--seed {seed} --max-ranks 4)")


def test_every_draw_resolves_or_is_refused_in_one_line():
    """Resolution alone (no worker): 150 draws of up to 8 ranks; a refusal is one ConfigError line naming a field,
    anything else raised is a bug; most draws run."""
    refused = 0
    for overrides in fuzz.draws(150, seed=20261129, max_ranks=8):
        try:
            config_resolve.resolve(Config.load(overrides=fuzz.texts({**fuzz.BASE, **overrides})), tokenizer_vocab=257)
        except ConfigError as e:
            refused += 1
            assert "\n" not in str(e) and str(e).split("=")[0].count(".") == 1, str(e)
    assert refused < 75, f"{refused} of 150 draws refused: the fuzzer wastes its draws"


class _Planted(fuzz.Checker):
    """A checker whose "bug" is pipeline parallelism with a mixture of experts (no training)."""

    def __init__(self):
        self.calls = 0

    def check(self, overrides):
        self.calls += 1
        bad = overrides.get("parallel.pp", 1) > 1 and overrides.get("model.n_experts")
        return fuzz.Outcome("failed" if bad else "equal", "planted", overrides)


def test_a_failure_shrinks_to_its_cause_and_prints_as_one_command():
    drawn = {**dict.fromkeys(fuzz.REQUIRED, 4), "model.d_model": 64, "model.flavor": "llama", "model.n_kv_heads": 2,
             "model.n_experts": 4,
             "model.dropout": 0.1, "parallel.nproc": 8, "parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 1,
             "train.global_batch": 8, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2}
    checker = _Planted()
    small = fuzz.shrink(checker, fuzz.Outcome("failed", "planted", drawn))
    o = small.overrides
    assert (o["parallel.pp"], o["model.n_experts"], o["parallel.nproc"]) == (2, 4, 2), o
    assert o["model.flavor"] == "gpt2" and not {"parallel.tp", "parallel.zero", "model.dropout"} & set(o), o
    assert (o["model.n_layers"], o["model.d_model"], o["train.steps"]) == (2, 32, 1), o
    command = fuzz.replay_command(o)
    assert command.startswith("python scripts/fuzz_layouts.py --replay ") and "\n" not in command
    assert fuzz.parse_replay(command.split("--replay ")[1].split()) == o


# ---- what the fuzzer found ------------------------------------------------------------------------------------

FOUND = {
    # an MLM micro-batch whose windows had no chosen target (0.85^16 = 7 % of 16-token windows) had the loss 0 / 0:
    # "loss became nan at step 2" in one process and in every layout (data/mlm.py now chooses at least one)
    "mlm-micro-batch-without-a-target": {
        "data.seq_len": 16, "model.d_model": 32, "model.flavor": "bert", "model.max_seq_len": 16, "model.n_heads": 4,
        "model.n_layers": 2, "parallel.nproc": 2, "train.global_batch": 4, "train.grad_accum": 2,
        "train.objective": "mlm", "train.seed": 208, "train.steps": 2},
}
"""Each bug the fuzzer found, as it shrank it: the config must now train the one-process model."""


def test_what_the_fuzzer_found_trains_the_one_process_model(cache_dir):
    checker = fuzz.Checker(cache_dir)
    for name, overrides in FOUND.items():
        outcome = checker.check(overrides)
        assert outcome.kind == "equal", f"{name}: {fuzz.describe_failure(outcome)}"


def test_every_mlm_window_has_a_target():
    import torch

    from shardwise.data.mlm import mask_window

    tokens = torch.arange(16)
    counts = [int((mask_window(tokens, 208, i, 300, 257)[1] != -100).sum()) for i in range(200)]
    assert min(counts) == 1 and max(counts) > 1, counts  # window 11 of seed 208 drew none before


def test_moe_first_forward_inside_a_checkpointed_block():
    """Found by the fuzzer (bert MoE, full recompute, dp 8: the validation split too small to give every rank a window,
    so the first forward was a checkpointed one): the experts' first call probes whether the grouped GEMM runs, and
    the probe's tensors were saved by the enclosing checkpoint -- "a different number of tensors was saved during the
    original forward and recomputation" (49 and 46). A resumed MoE run with train.recompute=full (no evaluation at
    its first step) met the same."""
    import torch

    from shardwise.model import Transformer
    from shardwise.parallel.recompute import apply_recompute

    cfg = config_resolve.resolve(Config.load(overrides=fuzz.texts({
        "model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": 2, "model.d_model": 32,
        "model.n_heads": 2, "model.max_seq_len": 16, "model.n_experts": 4, "parallel.nproc": 1})), tokenizer_vocab=257)
    model = Transformer(cfg.model)
    apply_recompute(model, "full")
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
