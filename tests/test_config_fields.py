"""Every field of the config tree does what it says: the same on the command line as in TOML, and
either honoured by the layout or refused with one line before any worker starts.

The choices and the fields are walked from the code (``CHOICES``, the dataclasses), so a new choice or
a new field is covered, or fails here until it is: a new field needs an entry in ``PROOFS``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w

import shardwise.config as config_module
from shardwise import config_resolve
from shardwise.cli import main, split_overrides
from shardwise.config import CHOICES, Config, ConfigError, key_name

SRC = Path(config_module.__file__).parent
BASE = {"parallel.nproc": "2"}
"""Two workers whatever the machine (the default would count GPUs): dp = 2."""


def all_fields() -> list[str]:
    """Every field under its config key (a keyword's attribute ``async_`` is the key ``async``)."""
    cfg = Config()
    return [f"{s.name}.{key_name(f.name)}" for s in dataclasses.fields(cfg)
            for f in dataclasses.fields(getattr(cfg, s.name))]


def field_docs() -> dict[str, str]:
    """The docstring under each field of the config dataclasses, read from config.py's source."""
    sections = {type(getattr(Config(), s.name)).__name__: s.name for s in dataclasses.fields(Config)}
    docs = {}
    for node in ast.parse(inspect.getsource(config_module)).body:
        if isinstance(node, ast.ClassDef) and node.name in sections:
            for stmt, after in itertools.pairwise(node.body):
                if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr):
                    docs[f"{sections[node.name]}.{key_name(stmt.target.id)}"] = after.value.value
    return docs


def texts(overrides: dict) -> dict[str, str]:
    """Overrides as the command line gives them."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()}


def resolve(overrides: dict) -> Config:
    return config_resolve.resolve(Config.load(overrides=texts({**BASE, **overrides})), tokenizer_vocab=257)


# ---- 1. every documented choice: the same value in TOML and on the command line --------------------


def _context(dotted: str, value, tmp_path: Path) -> dict:
    """What else a choice needs to be read (a pipeline for its schedule, ZeRO for offload, ...)."""
    if dotted == "model.preset" and value == "custom":
        return {"model.flavor": "gpt2", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4,
                "model.max_seq_len": 64}
    if (dotted, value) == ("model.flavor", "bert"):
        return {"train.objective": "mlm"}
    if (dotted, value) == ("train.objective", "mlm"):
        return {"model.flavor": "bert"}
    if (dotted, value) == ("train.objective", "classify"):
        return {"model.flavor": "bert", "model.n_classes": 2, "data.source": str(labelled(tmp_path))}
    if dotted == "data.format":
        return {"data.source": str(tmp_path)}
    if dotted == "model.moe_router":
        return {"model.n_experts": 4}
    if dotted in ("model.norm_placement", "model.mlp_activation", "model.hf_model_type"):
        return {"model.flavor": "llama"}
    if dotted == "model.qk_norm_scope":
        return {"model.flavor": "llama", "model.qk_norm": True}
    if dotted == "parallel.offload":
        return {"parallel.zero": 1}
    if dotted == "parallel.zero_param_dtype":
        return {"parallel.zero": 1, "train.precision": "bf16"}
    if dotted == "parallel.pp_schedule":
        return {"parallel.pp": 2, **({"parallel.pp_virtual": 2} if value == "interleaved" else {})}
    if dotted == "parallel.pp_partition":
        return {"parallel.pp": 2}
    if dotted in ("parallel.cp_algorithm", "parallel.cp_balance"):
        return {"parallel.cp": 2}
    if dotted == "parallel.ep_dispatch":
        return {"model.n_experts": 4, "parallel.ep": 2, "model.moe_capacity_factor": 1.0}
    if dotted.startswith("ps."):
        return {"ps.servers": 1}
    return {}


def labelled(tmp_path: Path) -> Path:
    """A one-document labelled jsonl source (train.objective classify)."""
    path = tmp_path / "labelled.jsonl"
    path.write_text('{"text": "a b", "label": 1}\n')
    return path


EXTRA_VALUES = {"parallel.pp_partition": ("2",), "data.tokenizer": ("{tmp}/tokenizer.json",)}
"""Documented forms beyond the named choices: stage boundaries, a tokenizer file."""

CASES = [(d, v) for d, options in CHOICES.items() for v in (*options, *EXTRA_VALUES.get(d, ()))]


def _outcome(load) -> Config | str:
    try:
        return config_resolve.resolve(load(), tokenizer_vocab=257)
    except ConfigError as e:
        return f"error: {e}"


@pytest.mark.parametrize(("dotted", "value"), CASES, ids=[f"{d}={v}" for d, v in CASES])
def test_every_choice_is_the_same_in_toml_and_on_the_command_line(dotted, value, tmp_path):
    value = value.format(tmp=tmp_path) if isinstance(value, str) else value
    (tmp_path / "tokenizer.json").write_text("{}")
    given = {**BASE, **_context(dotted, value, tmp_path), dotted: value}
    tree: dict[str, dict] = {}
    for key, v in given.items():
        section, _, name = key.partition(".")
        tree.setdefault(section, {})[name] = int(v) if key == "parallel.nproc" else v
    toml = tmp_path / "c.toml"
    toml.write_text(tomli_w.dumps(tree))
    argv = ["config", "show"] + [a for k, v in texts(given).items() for a in (f"--{k}", v)]
    _, overrides = split_overrides(argv)

    from_toml = _outcome(lambda: Config.load(toml))
    from_cli = _outcome(lambda: Config.load(overrides=overrides))
    assert from_cli == from_toml
    if (dotted, value) == ("run.device", "cuda") and not __import__("torch").cuda.is_available():
        assert from_cli == "error: run.device='cuda' but no GPU is visible; use 'cpu' or 'auto'"
        return
    assert not isinstance(from_cli, str), from_cli
    section, _, name = dotted.partition(".")
    assert getattr(getattr(from_cli, section), name) == value


def test_none_is_text_for_a_text_field_and_unsets_an_optional_one(capsys):
    cfg = Config.load(overrides={"train.recompute": "none", "parallel.offload": "none", "model.flavor": "none",
                                 "train.global_batch": "null", "train.micro_batch": "2", "train.grad_accum": "2",
                                 "run.dir": "1e3", "data.cache_dir": "true"})
    assert (cfg.train.recompute, cfg.parallel.offload) == ("none", "none")
    assert (cfg.model.flavor, cfg.train.global_batch) == (None, None)
    assert (cfg.run.dir, cfg.data.cache_dir) == ("1e3", "true"), "text fields keep the text as typed"
    with pytest.raises(ConfigError, match=r"train.steps='none' is not an integer"):
        Config.load(overrides={"train.steps": "none"})
    assert main(["config", "show", "--train.recompute", "none", "--parallel.offload", "none"]) == 0
    assert 'recompute = "none"' in capsys.readouterr().out


def test_choice_tuples_equal_their_consumers():
    """config.py holds the choices without importing torch; they must not drift from the code that runs them."""
    from shardwise.data.sources import FORMATS
    from shardwise.dist.comm.allreduce import ALL_REDUCE_ALGORITHMS
    from shardwise.dist.comm.compress import COMPRESSIONS
    from shardwise.parallel.pipeline import SCHEDULES
    from shardwise.parallel.pipeline.partition import METHODS

    assert CHOICES["parallel.pp_schedule"] == SCHEDULES
    assert CHOICES["parallel.pp_partition"] == METHODS
    assert CHOICES["data.format"] == FORMATS
    assert CHOICES["comm.compression"] == COMPRESSIONS
    from shardwise.ps.consistency import MODES
    from shardwise.ps.scheduling import POLICIES

    assert CHOICES["ps.consistency"] == MODES and CHOICES["ps.scheduling"] == POLICIES
    assert set(CHOICES["comm.algorithm"]) == {"auto", *ALL_REDUCE_ALGORITHMS}


FREE_TEXT = {"data.source", "data.text_field", "data.cache_dir", "parallel.offload_dir", "run.dir", "run.fault",
             "parallel.rdzv_endpoint", "ps.straggler", "model.init_from", "data.label_field", "model.rope_scaling"}
"""Text fields that are not a choice among names (paths, a column name, "RANK:MS")."""


def test_every_text_field_is_a_choice_or_free_text():
    """A new text field with named values must enter CHOICES (and so the test above)."""
    cfg = Config()
    text = {f"{s.name}.{name}" for s in dataclasses.fields(cfg)
            for name, hint in typing.get_type_hints(type(getattr(cfg, s.name))).items()
            if str in (typing.get_args(hint) or (hint,))}
    assert set(CHOICES) <= set(all_fields()) and FREE_TEXT <= text
    assert not text - FREE_TEXT - set(CHOICES), "a text field is neither in CHOICES nor FREE_TEXT"


# ---- 2. every field is honoured or refused --------------------------------------------------------


@dataclass(frozen=True)
class Reads:
    """Read as ``.field`` (or ``pattern``) in each of these files under src/shardwise (not config*.py)."""

    files: tuple[str, ...]
    pattern: str = ""


@dataclass(frozen=True)
class Derives:
    """A non-default value changes these resolved fields."""

    overrides: dict
    changes: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """With these overrides (the field among them) resolution fails with one line that starts with the field
    and contains ``fragment``; without the field the same layout resolves."""

    overrides: dict
    fragment: str


def reads(*files: str, pattern: str = "") -> Reads:
    return Reads(files, pattern)


def llama_only(key: str, value) -> Refused:
    """A field of the llama flavour's architecture, refused under the default gpt2 flavour."""
    return Refused({f"model.{key}": value}, "model.flavor='gpt2' does not use it")


NOT_IMPLEMENTED: set[str] = set()
"""Named in the tree for the planner and refused by the trainer until the technique exists."""

PROOFS: dict[str, tuple] = {
    "model.preset": (Derives({"model.preset": "tiny"}, ("model.d_model", "model.n_layers")),),
    "model.flavor": (reads("model/transformer.py"),),
    "model.n_layers": (reads("model/transformer.py"),),
    "model.d_model": (reads("model/transformer.py"),),
    "model.n_heads": (reads("model/transformer.py"),),
    "model.n_kv_heads": (reads("model/transformer.py"),
                         Refused({"model.n_kv_heads": 2}, "the gpt2 flavor has no grouped-query attention")),
    "model.d_ff": (reads("model/transformer.py"),),
    "model.vocab_size": (reads("model/transformer.py"),),
    "model.max_seq_len": (reads("model/transformer.py"),),
    "model.norm_eps": (reads("model/transformer.py"),),
    "model.rope_theta": (reads("model/transformer.py"),
                         Refused({"model.rope_theta": 5e5}, "model.flavor='gpt2' does not use")),
    "model.dropout": (reads("model/transformer.py"),),
    "model.tie_embeddings": (reads("model/transformer.py"),),
    "model.init_std": (reads("model/transformer.py"),),
    "model.n_classes": (reads("model/transformer.py"),
                        Refused({"model.n_classes": 3}, "but train.objective='causal'")),
    "model.init_from": (reads("train/loop.py", "hf/init.py"),
                        Refused({"model.init_from": "gpt2"}, "use 'hf:PATH'")),
    "model.n_experts": (reads("model/transformer.py"),),
    "model.moe_top_k": (reads("model/transformer.py"), Refused({"model.moe_top_k": 1}, "but model.n_experts=0"),
                        Refused({"model.n_experts": 4, "model.moe_top_k": 5}, "must be in 1..model.n_experts=4")),
    "model.moe_every": (reads("model/transformer.py"), Refused({"model.moe_every": 2}, "but model.n_experts=0")),
    "model.moe_shared": (reads("model/transformer.py"), Refused({"model.moe_shared": 1}, "but model.n_experts=0")),
    "model.moe_capacity_factor": (reads("model/transformer.py"),
                                  Refused({"model.moe_capacity_factor": 1.25}, "but model.n_experts=0"),
                                  Refused({"model.n_experts": 4, "model.moe_capacity_factor": 1.0, "parallel.tp": 2,
                                           "parallel.sequence_parallel": True}, "use model.moe_capacity_factor=0")),
    "model.moe_aux_coeff": (reads("model/transformer.py"),
                            Refused({"model.moe_aux_coeff": 0.1}, "but model.n_experts=0")),
    "model.moe_z_coeff": (reads("model/transformer.py"), Refused({"model.moe_z_coeff": 0.1}, "but model.n_experts=0")),
    "model.moe_router": (reads("model/transformer.py"),
                         Refused({"model.moe_router": "softmax_renorm"}, "but model.n_experts=0"),
                         Refused({"model.n_experts": 4, "model.moe_router": "top1"}, "is not valid; use one of")),
    "model.moe_bias_rate": (reads("model/transformer.py"),
                            Refused({"model.n_experts": 4, "model.moe_bias_rate": 0.01},
                                    "but model.moe_router='softmax' has none")),
    "model.moe_d_ff": (reads("model/transformer.py"), Refused({"model.moe_d_ff": 32}, "but model.n_experts=0")),
    "model.qk_norm": (reads("model/transformer.py"), Refused({"model.qk_norm": True}, "model.flavor='gpt2' has none")),
    "model.qk_norm_scope": (reads("model/transformer.py"), Refused({"model.flavor": "llama", "model.qk_norm_scope":
                                                                    "projection"}, "model.qk_norm=false")),
    "model.head_dim": (reads("model/transformer.py"), llama_only("head_dim", 16)),
    "model.qkv_bias": (reads("model/transformer.py"), llama_only("qkv_bias", True)),
    "model.rope_scaling": (reads("model/transformer.py"), llama_only("rope_scaling", "linear:factor=2"),
                           Refused({"model.flavor": "llama", "model.rope_scaling": "dynamic:factor=2"},
                                   "dynamic and longrope depend on each input's length")),
    "model.rope_dim": (reads("model/transformer.py"),
                       Refused({"model.flavor": "llama", "model.rope_dim": 3}, "must be even")),
    "model.rope_local_theta": (reads("model/transformer.py"),
                               Refused({"model.flavor": "llama", "model.rope_local_theta": 100.0},
                                       "set model.sliding_window and model.sliding_global_every")),
    "model.sliding_window": (reads("model/transformer.py"), llama_only("sliding_window", 8)),
    "model.sliding_global_every": (reads("model/transformer.py"),
                                   Refused({"model.flavor": "llama", "model.sliding_global_every": 2},
                                           "model.sliding_window=0")),
    "model.attn_scale_dim": (reads("model/transformer.py"), llama_only("attn_scale_dim", 24.0)),
    "model.attn_softcap": (reads("model/transformer.py"), llama_only("attn_softcap", 50.0)),
    "model.final_softcap": (reads("model/transformer.py"), llama_only("final_softcap", 30.0)),
    "model.norm_placement": (reads("model/transformer.py"), llama_only("norm_placement", "sandwich")),
    "model.norm_unit_offset": (reads("model/transformer.py"), llama_only("norm_unit_offset", True)),
    "model.mlp_activation": (reads("model/transformer.py"), llama_only("mlp_activation", "gelu_tanh"),
                             Refused({"model.flavor": "llama", "model.n_experts": 4, "model.mlp_activation":
                                      "gelu_tanh"}, "our experts are SwiGLU")),
    "model.embed_scale": (reads("model/transformer.py"), llama_only("embed_scale", True)),
    "model.kv_lora_rank": (reads("model/transformer.py"), llama_only("kv_lora_rank", 8)),
    "model.q_lora_rank": (reads("model/transformer.py"),
                          Refused({"model.flavor": "llama", "model.q_lora_rank": 8}, "set model.kv_lora_rank")),
    "model.v_head_dim": (reads("model/transformer.py"),
                         Refused({"model.flavor": "llama", "model.v_head_dim": 8}, "set model.kv_lora_rank")),
    "model.moe_dense_first": (reads("model/transformer.py"),
                              Refused({"model.moe_dense_first": 1}, "but model.n_experts=0")),
    "model.moe_groups": (reads("model/transformer.py"), Refused({"model.moe_groups": 2}, "but model.n_experts=0"),
                         Refused({"model.n_experts": 4, "model.moe_groups": 3}, "does not divide model.n_experts=4")),
    "model.moe_group_top_k": (reads("model/transformer.py"),
                              Refused({"model.n_experts": 4, "model.moe_group_top_k": 2}, "model.moe_groups=1")),
    "model.moe_gate_scale": (reads("model/transformer.py"),
                             Refused({"model.moe_gate_scale": 2.5}, "but model.n_experts=0")),
    "model.hf_model_type": (reads("hf/decoder_config.py"),
                            llama_only("hf_model_type", "qwen3")),
    "data.source": (reads("data/cache.py"),),
    "data.format": (reads("data/cache.py"), Refused({"data.format": "jsonl"}, "data.source='stdlib'")),
    "data.text_field": (reads("data/cache.py"), Refused({"data.text_field": "body"}, "read as plain text")),
    "data.tokenizer": (reads("data/cache.py"),),
    "data.bpe_vocab_size": (reads("data/cache.py"),
                            Refused({"data.bpe_vocab_size": 300}, "but data.tokenizer='byte'")),
    "data.seq_len": (reads("train/loop.py"),),
    "data.val_fraction": (reads("data/cache.py"),),
    "data.max_bytes": (reads("data/cache.py"),),
    "data.cache_dir": (reads("data/cache.py"),),
    "data.label_field": (reads("data/labelled.py"),
                         Refused({"data.label_field": "y"}, "but train.objective='causal'")),
    "train.steps": (reads("train/loop.py"),),
    "train.global_batch": (reads("train/loop.py"), Derives({"train.global_batch": 16}, ("train.micro_batch",))),
    "train.micro_batch": (reads("train/loop.py"), Derives({"train.micro_batch": 4}, ("train.grad_accum",))),
    "train.grad_accum": (Derives({"train.grad_accum": 2}, ("train.micro_batch",)),),
    "train.lr": (reads("train/optim.py"),),
    "train.min_lr": (reads("train/optim.py"),),
    "train.warmup_steps": (reads("train/optim.py"),),
    "train.weight_decay": (reads("train/optim.py"),),
    "train.beta1": (reads("train/optim.py"),),
    "train.beta2": (reads("train/optim.py"),),
    "train.eps": (reads("train/optim.py"),),
    "train.grad_clip": (reads("train/loop.py"),),
    "train.skip_grad_norm_above": (reads("train/loop.py"),),  # behaviour: tests/test_skip_steps.py
    "train.max_skipped_steps": (reads("train/loop.py"),),  # behaviour: tests/test_skip_steps.py
    "train.seed": (reads("train/loop.py"),),
    "train.precision": (reads("train/loop.py"),),
    "train.fp16_init_scale": (reads("train/loop.py"),
                              Refused({"train.fp16_init_scale": 1024}, "train.precision='bf16' has none")),
    "train.fp16_growth_interval": (reads("train/loop.py"),
                                   Refused({"train.precision": "fp32", "train.fp16_growth_interval": 100},
                                           "train.precision='fp32' has none")),
    "train.recompute": (reads("parallel/parallelize.py"),),
    "train.recompute_every": (reads("parallel/parallelize.py"),
                              Refused({"train.recompute_every": 2}, "but train.recompute='none'")),
    "train.compile": (reads("parallel/parallelize.py"),),
    "train.eval_every": (reads("train/loop.py"),),
    "train.eval_batches": (reads("train/loop.py"),),
    "train.peak_flops": (reads("train/loop.py"),),
    "train.objective": (reads("data/objectives.py"),
                        Refused({"train.objective": "mlm"}, "model.flavor='gpt2' is causal")),
    "parallel.nproc": (reads("launch.py"), Derives({"parallel.nproc": 1}, ("parallel.dp",))),
    "parallel.nnodes": (reads("launch.py"), Derives({"parallel.nnodes": 2}, ("parallel.dp",))),
    "parallel.rdzv_endpoint": (reads("launch.py"), Refused({"parallel.rdzv_endpoint": "n0:29400"}, "nnodes=1")),
    "parallel.rdzv_timeout_s": (reads("launch.py"), Refused({"parallel.rdzv_timeout_s": 5}, "nnodes=1")),
    "parallel.dp": (reads("dist/mesh.py"),),
    "parallel.tp": (reads("dist/mesh.py"), Derives({"parallel.tp": 2}, ("parallel.dp",))),
    "parallel.pp": (reads("train/engine.py"), Derives({"parallel.pp": 2}, ("parallel.dp", "parallel.microbatches"))),
    "parallel.cp": (reads("dist/mesh.py"), Derives({"parallel.cp": 2}, ("parallel.dp",))),
    "parallel.cp_algorithm": (reads("parallel/context/apply.py"),
                              Refused({"parallel.cp_algorithm": "ulysses"}, "but parallel.cp=1")),
    "parallel.cp_balance": (reads("parallel/context/apply.py"),
                            Refused({"parallel.cp_balance": "none"}, "but parallel.cp=1")),
    "parallel.etp": (reads("parallel/parallelize.py", pattern=r"cfg\.parallel\.etp > 1"),
                     Refused({"parallel.tp": 2, "parallel.etp": 2}, "needs a mixture-of-experts model"),
                     Refused({"model.n_experts": 4, "parallel.nproc": 4, "parallel.tp": 2, "parallel.etp": 4},
                             "experts split over the tensor-parallel ranks only")),
    "parallel.ep": (reads("parallel/parallelize.py", pattern=r'mesh\.size\("ep"\)'),
                    Refused({"parallel.ep": 2}, "needs a mixture-of-experts model"),
                    Refused({"model.n_experts": 4, "parallel.nproc": 4, "parallel.ep": 3}, "does not divide"),
                    Refused({"model.n_experts": 4, "parallel.nproc": 2, "parallel.ep": 4},
                            "parallel.ep=4 does not divide parallel.dp*cp=2")),
    "parallel.ep_dispatch": (reads("parallel/parallelize.py"),
                             Refused({"parallel.ep_dispatch": "padded"}, "but parallel.ep=1"),
                             Refused({"model.n_experts": 4, "parallel.ep": 2, "parallel.ep_dispatch": "padded"},
                                     "needs model.moe_capacity_factor > 0")),
    "parallel.zero": (reads("train/engine.py"),),
    "parallel.zero_unit": (reads("train/engine.py"),
                           Refused({"parallel.zero": 2, "parallel.zero_unit": 2}, "set parallel.zero=3")),
    "parallel.offload": (reads("train/engine.py"), Refused({"parallel.offload": "cpu"}, "needs ZeRO")),
    "parallel.zero_param_dtype": (reads("train/engine.py"),
                                  Refused({"parallel.zero_param_dtype": "bf16"}, "needs parallel.zero >= 1"),
                                  Refused({"parallel.zero": 1, "train.precision": "fp32",
                                           "parallel.zero_param_dtype": "bf16"}, "train.precision='bf16'")),
    "parallel.offload_dir": (reads("train/engine.py"),
                             Refused({"parallel.zero": 1, "parallel.offload_dir": "/tmp/x"}, "offload='none'")),
    "parallel.zero_quant_weights": (reads("train/engine.py"),
                                    Refused({"parallel.zero": 2, "parallel.zero_quant_weights": True}, "zero=3")),
    "parallel.zero_quant_grads": (reads("train/engine.py"),
                                  Refused({"parallel.zero_quant_grads": True}, "needs ZeRO")),
    "parallel.zero_hpz": (reads("train/engine.py"),
                          Refused({"parallel.zero": 2, "parallel.zero_hpz": 2}, "set parallel.zero=3")),
    "parallel.zero_overlap_param_gather": (reads("train/engine.py"),
                                           Refused({"parallel.zero": 3, "parallel.zero_overlap_param_gather": False},
                                                   "but parallel.zero=3")),
    "parallel.zero_overlap_grad_reduce": (reads("train/engine.py"),
                                          Refused({"parallel.zero_overlap_grad_reduce": False}, "but parallel.zero=0")),
    "parallel.grad_reduce_dtype": (reads("train/engine.py"),
                                   Refused({"parallel.grad_reduce_dtype": "bf16", "comm.compression": "fp16"},
                                           "both set how gradients travel"),
                                   Refused({"parallel.zero": 2, "parallel.zero_quant_grads": True,
                                            "parallel.grad_reduce_dtype": "bf16"}, "int8 blocks")),
    "parallel.tp_comm_overlap": (reads("parallel/parallelize.py"),
                                 Refused({"parallel.tp_comm_overlap": True}, "but parallel.tp=1"),
                                 Refused({"parallel.nproc": 4, "parallel.tp": 2, "parallel.pp": 2,
                                          "parallel.pp_schedule": "zb-h1", "parallel.tp_comm_overlap": True},
                                         "zb-h1")),
    "parallel.pp_schedule": (reads("train/engine.py"),
                             Refused({"parallel.pp_schedule": "gpipe"}, "but parallel.pp=1")),
    "parallel.microbatches": (reads("train/engine.py"),
                              Refused({"parallel.microbatches": 4}, "use train.grad_accum=4")),
    "parallel.pp_virtual": (reads("train/engine.py"),
                            Refused({"parallel.pp_virtual": 2}, "needs parallel.pp > 1"),
                            Refused({"parallel.pp": 2, "parallel.pp_virtual": 2}, "needs pp_schedule='interleaved'")),
    "parallel.pp_partition": (reads("parallel/pipeline/partition.py"),
                              Refused({"parallel.pp_partition": "flops"}, "but parallel.pp=1")),
    "parallel.pp_embedding_slot": (reads("parallel/pipeline/partition.py"),
                                   Refused({"parallel.pp_embedding_slot": True}, "but parallel.pp=1"),
                                   Refused({"parallel.pp": 2, "parallel.pp_embedding_slot": True},
                                           "pp_partition='params'")),
    "parallel.pp_head_slot": (reads("parallel/pipeline/partition.py"),
                              Refused({"parallel.pp_head_slot": True}, "but parallel.pp=1")),
    "parallel.sequence_parallel": (reads("parallel/parallelize.py"),
                                   Refused({"parallel.sequence_parallel": True}, "but parallel.tp=1")),
    "parallel.bucket_mb": (reads("train/engine.py"),
                           Refused({"parallel.zero": 3, "parallel.bucket_mb": 1}, "ZeRO-3 (parallel.zero=3)")),
    "parallel.backend": (reads("train/loop.py"),),
    "parallel.timeout_s": (reads("train/loop.py", pattern=r"parallel\.timeout_s"),),
    "comm.algorithm": (reads("dist/comm/compress.py"),
                       Refused({"parallel.zero": 1, "comm.algorithm": "auto"}, "use comm.algorithm='native'"),
                       Refused({"comm.compression": "int8", "comm.algorithm": "tree"}, "'native' (the backend's)")),
    "comm.compression": (reads("dist/comm/compress.py"),
                         Refused({"parallel.zero": 2, "comm.compression": "int8"}, "parallel.zero_quant_grads")),
    "comm.topk_ratio": (reads("dist/comm/compress.py"),
                        Refused({"comm.topk_ratio": 0.1}, "but comm.compression='none'")),
    "comm.node_size": (reads("dist/comm/compress.py"),
                       Refused({"comm.node_size": 2}, "but comm.algorithm='native'")),
    "comm.timeout_s": (reads("dist/comm/compress.py", pattern=r"comm_cfg\.timeout_s"),
                       Refused({"comm.timeout_s": 30}, "comm.algorithm='native' runs the backend's"),
                       Refused({"parallel.zero": 3, "comm.algorithm": "native", "comm.timeout_s": 30},
                               "ZeRO (parallel.zero=3) runs the backend's")),
    "ps.servers": (reads("train/loop.py"), Derives({"ps.servers": 1}, ("parallel.dp",)),
                   Refused({"ps.servers": 2}, "leaves no worker among the 2 ranks"),
                   Refused({"ps.servers": 1, "parallel.zero": 1}, "use parallel.zero=0 or ps.servers=0"),
                   Refused({"ps.servers": 1, "model.n_experts": 4, "parallel.ep": 2},
                           "use parallel.ep=1 or ps.servers=0")),
    "ps.consistency": (reads("ps/runner.py"), Refused({"ps.consistency": "asp"}, "ps.servers=0"),
                       Refused({"ps.servers": 1, "ps.consistency": "asp", "model.n_experts": 4,
                                "model.moe_router": "sigmoid_bias"}, "the workers agree on only in lock-step")),
    "ps.staleness": (reads("ps/runner.py"),
                     Refused({"ps.servers": 1, "ps.staleness": 2}, "but ps.consistency='bsp'"),
                     Refused({"ps.servers": 1, "ps.consistency": "ssp", "ps.staleness": -1}, "non-negative")),
    "ps.partition_kb": (reads("ps/runner.py"), Refused({"ps.partition_kb": 64}, "ps.servers=0")),
    "ps.scheduling": (reads("ps/runner.py"), Refused({"ps.scheduling": "priority"}, "ps.servers=0")),
    "ps.credit_kb": (reads("ps/runner.py"),
                     Refused({"ps.servers": 1, "ps.credit_kb": 64}, "but ps.scheduling='fifo'")),
    "ps.straggler": (reads("ps/runner.py"), Refused({"ps.straggler": "1:100"}, "ps.servers=0"),
                     Refused({"ps.servers": 1, "ps.straggler": "1:100"}, "which is not a worker"),
                     Refused({"ps.servers": 1, "ps.straggler": "slow"}, "use 'RANK:MS'")),
    "ckpt.every": (reads("train/loop.py"),),
    "ckpt.keep": (reads("train/loop.py"),),
    "ckpt.resume": (reads("train/loop.py"),),
    "ckpt.async": (reads("train/loop.py", pattern=r"ckpt\.async_"),
                   Refused({"ckpt.async": True, "ps.servers": 1}, "the parameter server's checkpoints")),
    "run.dir": (reads("launch.py"),),
    "run.device": (Derives({"run.device": "cpu"}, ("parallel.backend",)),),
    "run.progress": (reads("train/loop.py"),),
    "run.tensorboard": (reads("train/loop.py"),),
    "run.max_restarts": (reads("launch.py"),),
    "run.fault": (reads("train/loop.py"), Refused({"run.fault": "kill@3:r5"}, "rank 5 does not exist")),
}
"""How each field is proven to matter: read by a named consumer, deriving other fields, and (for a field
read only in some layouts) refused in a layout that would not read it."""


def test_every_field_has_a_proof():
    missing = [d for d in all_fields() if d not in PROOFS]
    assert not missing, f"add {missing} to PROOFS: how is each honoured, or refused where it is not read?"
    assert not set(PROOFS) - set(all_fields()), "PROOFS names fields the tree no longer has"


def test_conditional_fields_are_refused_where_they_do_nothing():
    """A field documented as "With X: ..." is read only when X holds: it needs a refusal where X does not."""
    docs = field_docs()
    assert set(docs) == set(all_fields())
    conditional = [d for d, doc in docs.items() if doc.startswith("With ")]
    assert len(conditional) > 10
    for dotted in conditional:
        assert any(isinstance(p, Refused) for p in PROOFS.get(dotted, ())), f"{dotted} is never refused"


def _source(rel: str) -> str:
    assert not Path(rel).name.startswith("config"), "a consumer is code that uses the setting, not the config"
    return (SRC / rel).read_text()


@pytest.mark.parametrize("dotted", all_fields())
def test_field_is_honoured_or_refused(dotted):
    proofs = PROOFS.get(dotted)
    if proofs is None:
        pytest.fail(f"{dotted} has no entry in PROOFS")
    kinds = {type(p) for p in proofs}
    if dotted in NOT_IMPLEMENTED:
        assert kinds == {Refused}, f"{dotted} is not implemented: it can only be refused"
    else:
        assert kinds & {Reads, Derives}, f"{dotted}: nothing shows that it is honoured"
    base = resolve({})
    for proof in proofs:
        if isinstance(proof, Reads):
            pattern = proof.pattern or rf"\.{dotted.split('.')[1]}\b"
            for rel in proof.files:
                assert re.search(pattern, _source(rel)), f"{dotted}: {pattern!r} is not read in src/shardwise/{rel}"
        elif isinstance(proof, Derives):
            assert dotted in proof.overrides
            cfg = resolve(proof.overrides)
            for changed in proof.changes:
                section, _, name = changed.partition(".")
                assert getattr(getattr(cfg, section), name) != getattr(getattr(base, section), name), changed
        else:
            assert dotted in proof.overrides, "a refusal proves something about its own field"
            with pytest.raises(ConfigError) as e:
                resolve(proof.overrides)
            message = str(e.value)
            assert message.startswith(f"{dotted}=") and "\n" not in message, message
            assert proof.fragment in message, message
            resolve({k: v for k, v in proof.overrides.items() if k != dotted})  # the same layout without it


def test_refusal_on_the_command_line_names_the_field(capsys):
    assert main(["config", "show", "--parallel.microbatches", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: parallel.microbatches=4 counts a pipeline's micro-batches, but parallel.pp=1; "
        "use train.grad_accum=4 for micro-batches accumulated per step")
