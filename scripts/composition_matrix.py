"""Which layouts compose: every pair of the layout features a user combines, resolved as `shardwise train` would.

Each feature is a set of config overrides; a pair merges two of them (the world grows to the product of the
axes), and the config tree's own resolution (shardwise.config_resolve.resolve) accepts it or refuses it with
its one-line reason -- the same check that runs before any worker starts. Pairs of two settings of the same
field (tp 2 and tp 4, two schedules) are not combinations and are skipped.

    python scripts/composition_matrix.py            # markdown: the counts and every refusal with its reason
    python scripts/composition_matrix.py --json     # every pair and its outcome
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve

MOE = {"model.n_experts": 4}
FEATURES: dict[str, dict] = {
    "tp 2": {"parallel.tp": 2},
    "tp 2 + sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "pp 2 (1f1b)": {"parallel.pp": 2},
    "pp 2 interleaved": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2},
    "pp 2 zb-h1": {"parallel.pp": 2, "parallel.pp_schedule": "zb-h1"},
    "cp 2 ring": {"parallel.cp": 2},
    "cp 2 all-gather": {"parallel.cp": 2, "parallel.cp_algorithm": "allgather"},
    "cp 2 ulysses": {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
    "moe": MOE,
    "moe + ep 2": {**MOE, "parallel.ep": 2},
    "moe + etp 2 (tp 2)": {**MOE, "parallel.tp": 2, "parallel.etp": 2},
    "zero 1": {"parallel.zero": 1},
    "zero 2": {"parallel.zero": 2},
    "zero 3": {"parallel.zero": 3},
    "zero 3 + offload cpu": {"parallel.zero": 3, "parallel.offload": "cpu"},
    "zero 1 + int8 grads": {"parallel.zero": 1, "parallel.zero_quant_grads": True},
    "zero 3 + hpZ 2": {"parallel.zero": 3, "parallel.zero_hpz": 2},
    "dropout 0.1": {"model.dropout": 0.1},
    "recompute full": {"train.recompute": "full"},
    "recompute selective": {"train.recompute": "selective"},
    "bf16": {"train.precision": "bf16"},
    "fp16": {"train.precision": "fp16"},
    "int8 all-reduce": {"comm.compression": "int8"},
    "llama": {"model.flavor": "llama", "model.n_kv_heads": 2},
    "bert mlm": {"model.flavor": "bert", "train.objective": "mlm"},
    "parameter server": {"ps.servers": 1},
}
BASE = {"model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": 4, "model.d_model": 64, "model.n_heads": 4,
        "data.seq_len": 32, "train.global_batch": 16, "train.precision": "fp32", "run.device": "cpu"}
AXES = ("parallel.tp", "parallel.pp", "parallel.cp")
"""Model-parallel axes: the world is 2 data-parallel replicas of their product (and a parameter server's servers)."""


def outcome(overrides: dict) -> str | None:
    """None if the layout resolves, else its one-line refusal."""
    merged = {**BASE, **overrides}
    if merged.get("model.flavor") == "bert":
        merged.pop("model.n_kv_heads", None)
    model_parallel = 1
    for axis in AXES:
        model_parallel *= int(merged.get(axis, 1))
    merged["parallel.nproc"] = 2 * model_parallel + int(merged.get("ps.servers", 0))  # dp 2, and the servers
    cfg = Config()
    try:
        for key, value in merged.items():
            cfg.set(key, value)
        resolve(cfg, tokenizer_vocab=257)
    except ConfigError as e:
        return str(e)
    return None


def pairs() -> list[tuple[str, str, str | None]]:
    out = []
    for a, b in itertools.combinations(FEATURES, 2):
        if set(FEATURES[a]) & set(FEATURES[b]) - {"model.n_experts", "parallel.zero"}:
            continue  # two settings of one field
        if FEATURES[a].get("parallel.zero") and FEATURES[b].get("parallel.zero"):
            continue
        out.append((a, b, outcome({**FEATURES[a], **FEATURES[b]})))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    single = {name: outcome(f) for name, f in FEATURES.items()}
    rows = pairs()
    if args.json:
        print(json.dumps({"features": single, "pairs": [{"a": a, "b": b, "refused": r} for a, b, r in rows]}, indent=1))
        return 0
    refused = [(a, b, r) for a, b, r in rows if r]
    print(f"{len(FEATURES)} features, {len(rows)} pairs: {len(rows) - len(refused)} run, {len(refused)} refused.\n")
    for name, reason in single.items():
        if reason:
            print(f"- {name} alone: {reason}")
    print("\n| pair | why it is refused |\n|---|---|")
    for a, b, reason in refused:
        print(f"| {a} + {b} | {reason} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
