"""Every field of the config tree does what it says: the same on the command line as in TOML, and proven by
behaviour -- set away from its default it changes what it says it changes (the model, the data read, the
optimizer's steps, metrics, files written, processes started, bytes sent), or it is refused with one line before
any worker starts where the layout would not read it.

The choices and the fields are walked from the code (``CHOICES``, the dataclasses), so a new choice or a new
field is covered, or fails here until it is: a new field needs an entry in ``PROOFS``. The observers that see the
differences are in tests/field_probes.py; the trainer's runs (tiny model, 2 steps, 1-3 gloo ranks of the reusable
pool) are made once for all fields.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch

import shardwise.config as config_module
from shardwise import config_resolve
from shardwise.cli import main, split_overrides
from shardwise.config import CHOICES, Config, ConfigError, key_name
from tests import field_probes

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
    if (dotted, value) == ("run.device", "cuda") and not torch.cuda.is_available():
        assert from_cli == "error: run.device='cuda' but no GPU is visible; use 'cpu' or 'auto'"
        return
    if (dotted, value) == ("parallel.backend", "nccl") and not torch.cuda.is_available():
        assert from_cli == "error: parallel.backend='nccl' needs GPUs but no GPU is visible; use 'gloo' or 'auto'"
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


# ---- 2. every field changes what it says it changes, or is refused ----------------------------------


DEFAULT = field_probes.UNSET
UNSET = field_probes.UNSET


@dataclass(frozen=True)
class Acts:
    """Set to ``value`` (from ``base``: the observer's base config, else the field's default), with ``context``
    set in both runs and ``also`` only with ``value``, the field changes ``aspect`` ("OBSERVER:WHAT", see
    tests/field_probes.py) -- where the field says it acts."""

    value: Any
    aspect: str
    context: dict = dataclasses.field(default_factory=dict)
    base: Any = DEFAULT
    also: dict = dataclasses.field(default_factory=dict)

    def runs(self, dotted: str) -> tuple[dict, dict]:
        base = {**self.context} if self.base is DEFAULT else {**self.context, dotted: self.base}
        return base, {**self.context, **self.also, dotted: self.value}


@dataclass(frozen=True)
class Refused:
    """With these overrides (the field among them) resolution fails with one line that starts with the field
    and contains ``fragment``; without the field the same layout resolves."""

    overrides: dict
    fragment: str


def llama_only(key: str, value) -> Refused:
    """A field of the llama flavour's architecture, refused under the default gpt2 flavour."""
    return Refused({f"model.{key}": value}, "model.flavor='gpt2' does not use it")


LLAMA = {"model.flavor": "llama"}
MOE = {"model.n_experts": 4}
MLA = {**LLAMA, "model.kv_lora_rank": 8, "model.rope_dim": 4}
FP16 = {"train.precision": "fp16"}
CLASSIFY = {"model.flavor": "bert", "train.objective": "classify", "model.n_classes": 2,
            "data.source": "{corpus}/labelled.jsonl", "data.format": "jsonl"}
DP2 = {"parallel.nproc": 2}
TP2, PP2, CP2 = ({**DP2, f"parallel.{axis}": 2} for axis in ("tp", "pp", "cp"))
EP2 = {**DP2, **MOE, "parallel.ep": 2}
ZERO1, ZERO3 = {**DP2, "parallel.zero": 1}, {**DP2, "parallel.zero": 3}
EVEN_PP2 = {**PP2, "parallel.pp_partition": "even"}
PS = {**DP2, "ps.servers": 1}
PS3 = {"parallel.nproc": 3, "ps.servers": 1, "ps.straggler": "1:200"}
"""Two workers and a server; worker 1 (global rank 1) sleeps 0.2 s a step, so worker 0 (which writes metrics.jsonl)
runs ahead as far as the consistency lets it."""
NODES = {"parallel.nproc": 2, "parallel.nnodes": 2, "parallel.rdzv_endpoint": "127.0.0.1:29499",
         "train.global_batch": 12}
JSONL = {"data.source": "{corpus}/docs.jsonl"}

ONLY_REFUSED = {
    "parallel.dp": "states the world's shape: its one valid value is the derived one (world / (tp pp cp))",
    "parallel.backend": "on a machine without GPUs 'auto' is gloo and the other value, nccl, is refused "
                        "(the GPU tests run nccl)",
}
"""Fields no other valid value exists for here: their proof is the refusal of every other value."""

PROOFS: dict[str, tuple] = {
    # the model one process builds: its shape, initial values, loss and logits on fixed tokens
    "model.preset": (Acts("tiny-llama", "model:shape", base="tiny",
                          context={f"model.{k}": UNSET for k in ("flavor", "n_layers", "d_model", "n_heads",
                                                                 "max_seq_len")}),),
    "model.flavor": (Acts("llama", "model:shape"), Acts("bert", "model:shape", also={"train.objective": "mlm"})),
    "model.n_layers": (Acts(3, "model:shape"),),
    "model.d_model": (Acts(64, "model:shape"),),
    "model.n_heads": (Acts(2, "model:output"),),
    "model.n_kv_heads": (Acts(2, "model:shape", LLAMA),
                         Refused({"model.n_kv_heads": 2}, "the gpt2 flavor has no grouped-query attention")),
    "model.d_ff": (Acts(64, "model:shape"),),
    "model.vocab_size": (Acts(300, "model:shape"),),
    "model.max_seq_len": (Acts(32, "model:shape"),),
    "model.norm_eps": (Acts(0.5, "model:output"),),
    "model.rope_theta": (Acts(100.0, "model:output", LLAMA),
                         Refused({"model.rope_theta": 5e5}, "model.flavor='gpt2' does not use")),
    "model.dropout": (Acts(0.5, "model:output"),),
    "model.tie_embeddings": (Acts(False, "model:shape"), Acts(True, "model:shape", LLAMA)),
    "model.init_std": (Acts(0.5, "model:init"),),
    "model.n_classes": (Acts(3, "model:shape", CLASSIFY),
                        Refused({"model.n_classes": 3}, "but train.objective='causal'")),
    "model.init_from": (Acts("hf:{hf}", "train:losses"), Refused({"model.init_from": "gpt2"}, "use 'hf:PATH'")),
    "model.n_experts": (Acts(4, "model:shape"),),
    "model.moe_top_k": (Acts(1, "model:output", MOE), Refused({"model.moe_top_k": 1}, "but model.n_experts=0"),
                        Refused({"model.n_experts": 4, "model.moe_top_k": 5}, "must be in 1..model.n_experts=4")),
    "model.moe_every": (Acts(2, "model:shape", MOE), Refused({"model.moe_every": 2}, "but model.n_experts=0")),
    "model.moe_shared": (Acts(1, "model:shape", MOE), Refused({"model.moe_shared": 1}, "but model.n_experts=0")),
    "model.moe_capacity_factor": (Acts(0.5, "model:output", MOE),
                                  Refused({"model.moe_capacity_factor": 1.25}, "but model.n_experts=0"),
                                  Refused({"model.n_experts": 4, "model.moe_capacity_factor": 1.0, "parallel.tp": 2,
                                           "parallel.sequence_parallel": True}, "use model.moe_capacity_factor=0")),
    "model.moe_aux_coeff": (Acts(0.5, "model:output", MOE),
                            Refused({"model.moe_aux_coeff": 0.1}, "but model.n_experts=0")),
    "model.moe_z_coeff": (Acts(0.5, "model:output", MOE), Refused({"model.moe_z_coeff": 0.1}, "but model.n_experts=0")),
    "model.moe_router": (Acts("softmax_renorm", "model:output", MOE), Acts("sigmoid_bias", "model:output", MOE),
                         Refused({"model.moe_router": "softmax_renorm"}, "but model.n_experts=0"),
                         Refused({"model.n_experts": 4, "model.moe_router": "top1"}, "is not valid; use one of")),
    "model.moe_bias_rate": (Acts(0.1, "train:weights", {**MOE, "model.moe_router": "sigmoid_bias"}),
                            Refused({"model.n_experts": 4, "model.moe_bias_rate": 0.01},
                                    "but model.moe_router='softmax' has none")),
    "model.moe_d_ff": (Acts(16, "model:shape", MOE), Refused({"model.moe_d_ff": 32}, "but model.n_experts=0")),
    "model.qk_norm": (Acts(True, "model:shape", LLAMA),
                      Refused({"model.qk_norm": True}, "model.flavor='gpt2' has none")),
    "model.qk_norm_scope": (Acts("projection", "model:shape", {**LLAMA, "model.qk_norm": True}),
                            Refused({"model.flavor": "llama", "model.qk_norm_scope": "projection"},
                                    "model.qk_norm=false")),
    "model.head_dim": (Acts(16, "model:shape", LLAMA), llama_only("head_dim", 16)),
    "model.qkv_bias": (Acts(True, "model:shape", LLAMA), llama_only("qkv_bias", True)),
    "model.rope_scaling": (Acts("linear:factor=2", "model:output", LLAMA),
                           llama_only("rope_scaling", "linear:factor=2"),
                           Refused({"model.flavor": "llama", "model.rope_scaling": "dynamic:factor=2"},
                                   "dynamic and longrope depend on each input's length")),
    "model.rope_dim": (Acts(4, "model:output", LLAMA),
                       Refused({"model.flavor": "llama", "model.rope_dim": 3}, "must be even")),
    "model.rope_local_theta": (Acts(100.0, "model:output", {**LLAMA, "model.sliding_window": 4,
                                                            "model.sliding_global_every": 2}),
                               Refused({"model.flavor": "llama", "model.rope_local_theta": 100.0},
                                       "set model.sliding_window and model.sliding_global_every")),
    "model.sliding_window": (Acts(4, "model:output", LLAMA), llama_only("sliding_window", 8)),
    "model.sliding_global_every": (Acts(2, "model:output", {**LLAMA, "model.sliding_window": 4}),
                                   Refused({"model.flavor": "llama", "model.sliding_global_every": 2},
                                           "model.sliding_window=0")),
    "model.attn_scale_dim": (Acts(2.0, "model:output", LLAMA), llama_only("attn_scale_dim", 24.0)),
    "model.attn_softcap": (Acts(0.5, "model:output", LLAMA), llama_only("attn_softcap", 50.0)),
    "model.final_softcap": (Acts(0.5, "model:output", LLAMA), llama_only("final_softcap", 30.0)),
    "model.norm_placement": (Acts("sandwich", "model:shape", LLAMA), Acts("post", "model:output", LLAMA),
                             llama_only("norm_placement", "sandwich")),
    "model.norm_unit_offset": (Acts(True, "model:init", LLAMA), llama_only("norm_unit_offset", True)),
    "model.mlp_activation": (Acts("gelu_tanh", "model:output", LLAMA), llama_only("mlp_activation", "gelu_tanh"),
                             Refused({"model.flavor": "llama", "model.n_experts": 4, "model.mlp_activation":
                                      "gelu_tanh"}, "our experts are SwiGLU")),
    "model.embed_scale": (Acts(True, "model:output", LLAMA), llama_only("embed_scale", True)),
    "model.kv_lora_rank": (Acts(8, "model:shape", {**LLAMA, "model.rope_dim": 4}), llama_only("kv_lora_rank", 8)),
    "model.q_lora_rank": (Acts(8, "model:shape", MLA),
                          Refused({"model.flavor": "llama", "model.q_lora_rank": 8}, "set model.kv_lora_rank")),
    "model.v_head_dim": (Acts(4, "model:shape", MLA),
                         Refused({"model.flavor": "llama", "model.v_head_dim": 8}, "set model.kv_lora_rank")),
    "model.moe_dense_first": (Acts(1, "model:shape", MOE),
                              Refused({"model.moe_dense_first": 1}, "but model.n_experts=0")),
    "model.moe_groups": (Acts(2, "model:output", MOE), Refused({"model.moe_groups": 2}, "but model.n_experts=0"),
                         Refused({"model.n_experts": 4, "model.moe_groups": 3}, "does not divide model.n_experts=4")),
    "model.moe_group_top_k": (Acts(2, "model:output", {**MOE, "model.moe_groups": 2}),
                              Refused({"model.n_experts": 4, "model.moe_group_top_k": 2}, "model.moe_groups=1")),
    "model.moe_gate_scale": (Acts(2.5, "model:output", MOE),
                             Refused({"model.moe_gate_scale": 2.5}, "but model.n_experts=0")),
    "model.hf_model_type": (Acts("mistral", "train:export:model_type", {**LLAMA, "probe.export": True}),
                            llama_only("hf_model_type", "qwen3")),
    # the data the objective reads: tokens, vocabulary, labels, files in the cache
    "data.source": (Acts("{corpus}/docs.txt", "data:tokens"),),
    "data.format": (Acts("text", "data:tokens", JSONL), Refused({"data.format": "jsonl"}, "data.source='stdlib'")),
    "data.text_field": (Acts("body", "data:tokens", JSONL),
                        Refused({"data.text_field": "body"}, "read as plain text")),
    "data.tokenizer": (Acts("bpe", "data:vocab"), Acts("{corpus}/tokenizer.json", "data:vocab")),
    "data.bpe_vocab_size": (Acts(300, "data:vocab", {"data.tokenizer": "bpe"}),
                            Refused({"data.bpe_vocab_size": 300}, "but data.tokenizer='byte'")),
    "data.seq_len": (Acts(8, "data:tokens"),),
    "data.val_fraction": (Acts(0.3, "data:tokens"),),
    "data.max_bytes": (Acts(10_000, "data:tokens"),),
    "data.cache_dir": (Acts("{tmp}/b", "data:files", base="{tmp}/a"),),
    "data.label_field": (Acts("y", "data:labels", CLASSIFY),
                         Refused({"data.label_field": "y"}, "but train.objective='causal'")),
    # the trainer (one process unless the context says more): losses, weights, metrics, files, calls
    "train.steps": (Acts(3, "train:losses"),),
    "train.global_batch": (Acts(8, "train:losses"),),
    "train.micro_batch": (Acts(2, "train:losses", MOE),),  # a router's balance loss is per micro-batch
    "train.grad_accum": (Acts(2, "train:losses", MOE),),
    "train.lr": (Acts(1e-2, "train:weights"),),
    "train.min_lr": (Acts(1e-3, "train:metric:lr", {"train.steps": 3}),),
    "train.warmup_steps": (Acts(0, "train:metric:lr"),),
    "train.weight_decay": (Acts(0.0, "train:weights"),),
    "train.beta1": (Acts(0.5, "train:weights"),),
    "train.beta2": (Acts(0.5, "train:weights"),),
    "train.eps": (Acts(1e-2, "train:weights"),),
    "train.grad_clip": (Acts(0.0, "train:weights"),),
    "train.skip_grad_norm_above": (Acts(1e-9, "train:weights"),),  # every step's norm is above: all skipped
    "train.max_skipped_steps": (Acts(1, "train:error", {"train.skip_grad_norm_above": 1e-9}),),
    "train.seed": (Acts(7, "train:weights"),),
    "train.precision": (Acts("bf16", "train:losses"), Acts("fp16", "train:metric:loss_scale")),
    "train.fp16_init_scale": (Acts(1024.0, "train:metric:loss_scale", FP16),
                              Refused({"train.fp16_init_scale": 1024}, "train.precision='bf16' has none")),
    "train.fp16_growth_interval": (Acts(1, "train:metric:loss_scale", FP16),
                                   Refused({"train.precision": "fp32", "train.fp16_growth_interval": 100},
                                           "train.precision='fp32' has none")),
    "train.recompute": (Acts("full", "train:calls:Block.forward"), Acts("selective", "train:calls:Attention.core")),
    "train.recompute_every": (Acts(2, "train:calls:Block.forward", {"train.recompute": "full"}),
                              Refused({"train.recompute_every": 2}, "but train.recompute='none'")),
    "train.compile": (Acts(True, "train:calls:torch.compile"),),
    "train.eval_every": (Acts(1, "train:metric:val_loss"),),
    "train.eval_batches": (Acts(2, "train:metric:val_loss"),),
    "train.peak_flops": (Acts(2e12, "train:ratio:mfu/tokens_per_s"),),
    "train.objective": (Acts("mlm", "data:tokens", also={"model.flavor": "bert"}),
                        Refused({"train.objective": "mlm"}, "model.flavor='gpt2' is causal")),
    # processes, the layout's traffic and memory (measured by the run), the launcher
    "parallel.nproc": (Acts(2, "launch:nproc_per_node"),),
    "parallel.nnodes": (Acts(3, "launch:nodes", NODES, base=2),),
    "parallel.rdzv_endpoint": (Acts("127.0.0.1:29498", "launch:rdzv", NODES),
                               Refused({"parallel.rdzv_endpoint": "n0:29400"}, "nnodes=1")),
    "parallel.rdzv_timeout_s": (Acts(30.0, "launch:rdzv", NODES),
                                Refused({"parallel.rdzv_timeout_s": 5}, "nnodes=1")),
    "parallel.dp": (Refused({"parallel.dp": 1}, "does not match the world size 2"),),
    "parallel.tp": (Acts(2, "train:metric:tp_sent_bytes", DP2),),
    "parallel.pp": (Acts(2, "train:metric:pp_sent_bytes", DP2),),
    "parallel.cp": (Acts(2, "train:metric:cp_sent_bytes", DP2),),
    "parallel.cp_algorithm": (Acts("allgather", "train:metric:cp_sent_bytes", CP2),
                              Acts("ulysses", "train:metric:cp_sent_bytes", CP2),
                              Refused({"parallel.cp_algorithm": "ulysses"}, "but parallel.cp=1")),
    "parallel.cp_balance": (Acts("none", "train:metric:cp_attn_tiles", CP2),
                            Refused({"parallel.cp_balance": "none"}, "but parallel.cp=1")),
    "parallel.ep": (Acts(2, "train:metric:ep_sent_bytes", {**DP2, **MOE}),
                    Refused({"parallel.ep": 2}, "needs a mixture-of-experts model"),
                    Refused({"model.n_experts": 4, "parallel.nproc": 4, "parallel.ep": 3}, "does not divide"),
                    Refused({"model.n_experts": 4, "parallel.nproc": 2, "parallel.ep": 4},
                            "parallel.ep=4 does not divide parallel.dp*cp=2")),
    "parallel.ep_dispatch": (Acts("padded", "train:metric:ep_sent_bytes", {**EP2, "model.moe_capacity_factor": 1.0}),
                             Refused({"parallel.ep_dispatch": "padded"}, "but parallel.ep=1"),
                             Refused({"model.n_experts": 4, "parallel.ep": 2, "parallel.ep_dispatch": "padded"},
                                     "needs model.moe_capacity_factor > 0")),
    "parallel.etp": (Acts(2, "train:metric:mem_params_bytes", {**TP2, **MOE}),
                     Refused({"parallel.tp": 2, "parallel.etp": 2}, "needs a mixture-of-experts model"),
                     Refused({"model.n_experts": 4, "parallel.nproc": 4, "parallel.tp": 2, "parallel.etp": 4},
                             "experts split over the tensor-parallel ranks only")),
    "parallel.zero": (Acts(1, "train:metric:mem_optimizer_bytes", DP2), Acts(2, "train:metric:mem_grads_bytes", DP2),
                      Acts(3, "train:metric:mem_params_bytes", DP2)),
    "parallel.zero_unit": (Acts(2, "train:calls:isend", ZERO3),  # one ring gather per unit
                           Refused({"parallel.zero": 2, "parallel.zero_unit": 2}, "set parallel.zero=3")),
    "parallel.zero_param_dtype": (Acts("bf16", "train:metric:mem_params_bytes", {**ZERO1, "train.precision": "bf16"}),
                                  Refused({"parallel.zero_param_dtype": "bf16"}, "needs parallel.zero >= 1"),
                                  Refused({"parallel.zero": 1, "train.precision": "fp32",
                                           "parallel.zero_param_dtype": "bf16"}, "train.precision='bf16'")),
    "parallel.offload": (Acts("cpu", "train:metric:mem_master_bytes", ZERO1), Acts("disk", "train:files", ZERO1),
                         Refused({"parallel.offload": "cpu"}, "needs ZeRO")),
    "parallel.offload_dir": (Acts("{tmp}/b", "train:files", {**ZERO1, "parallel.offload": "disk"}, base="{tmp}/a"),
                             Refused({"parallel.zero": 1, "parallel.offload_dir": "/tmp/x"}, "offload='none'")),
    "parallel.zero_quant_weights": (Acts(True, "train:weights", ZERO3),
                                    Refused({"parallel.zero": 2, "parallel.zero_quant_weights": True}, "zero=3")),
    "parallel.zero_quant_grads": (Acts(True, "train:metric:dp_sent_bytes", ZERO1),
                                  Refused({"parallel.zero_quant_grads": True}, "needs ZeRO")),
    "parallel.zero_hpz": (Acts(2, "train:metric:mem_params_bytes", ZERO3),
                          Refused({"parallel.zero": 2, "parallel.zero_hpz": 2}, "set parallel.zero=3")),
    "parallel.zero_overlap_param_gather": (Acts(False, "train:calls:zero_gather_hook", ZERO1),
                                           Refused({"parallel.zero": 3, "parallel.zero_overlap_param_gather": False},
                                                   "but parallel.zero=3")),
    "parallel.zero_overlap_grad_reduce": (Acts(False, "train:metric:dp_reduced_in_backward", ZERO1),
                                          Refused({"parallel.zero_overlap_grad_reduce": False}, "but parallel.zero=0")),
    "parallel.grad_reduce_dtype": (Acts("bf16", "train:metric:dp_sent_bytes", ZERO1),
                                   Refused({"parallel.grad_reduce_dtype": "bf16", "comm.compression": "fp16"},
                                           "both set how gradients travel"),
                                   Refused({"parallel.zero": 2, "parallel.zero_quant_grads": True,
                                            "parallel.grad_reduce_dtype": "bf16"}, "int8 blocks")),
    "parallel.tp_comm_overlap": (Acts(True, "train:calls:all_reduce", TP2),  # the reductions cut in chunks
                                 Refused({"parallel.tp_comm_overlap": True}, "but parallel.tp=1"),
                                 Refused({"parallel.nproc": 4, "parallel.tp": 2, "parallel.pp": 2,
                                          "parallel.pp_schedule": "zb-h1", "parallel.tp_comm_overlap": True},
                                         "zb-h1")),
    "parallel.pp_schedule": (Acts("gpipe", "train:metric:pp_peak_live_0", PP2),
                             Acts("zb-h1", "train:metric:bubble_theory", PP2),
                             Refused({"parallel.pp_schedule": "gpipe"}, "but parallel.pp=1")),
    "parallel.microbatches": (Acts(2, "train:calls:isend", PP2),
                              Refused({"parallel.microbatches": 4}, "use train.grad_accum=4")),
    "parallel.pp_virtual": (Acts(3, "train:metric:pp_sent_bytes", {**PP2, "parallel.pp_schedule": "interleaved",
                                                                    "model.n_layers": 6}, base=2),
                            Refused({"parallel.pp_virtual": 2}, "needs parallel.pp > 1"),
                            Refused({"parallel.pp": 2, "parallel.pp_virtual": 2}, "needs pp_schedule='interleaved'")),
    "parallel.pp_partition": (Acts("2", "train:metric:mem_params_bytes", {**PP2, "model.n_layers": 3}),
                              Refused({"parallel.pp_partition": "flops"}, "but parallel.pp=1")),
    "parallel.pp_embedding_slot": (Acts(True, "train:metric:mem_params_bytes", EVEN_PP2 | {"model.n_layers": 3}),
                                   Refused({"parallel.pp_embedding_slot": True}, "but parallel.pp=1"),
                                   Refused({"parallel.pp": 2, "parallel.pp_embedding_slot": True},
                                           "pp_partition='params'")),
    "parallel.pp_head_slot": (Acts(True, "train:metric:mem_params_bytes", EVEN_PP2 | {"model.n_layers": 4}),
                              Refused({"parallel.pp_head_slot": True}, "but parallel.pp=1")),
    "parallel.sequence_parallel": (Acts(True, "train:metric:tp_sent_bytes", TP2),
                                   Refused({"parallel.sequence_parallel": True}, "but parallel.tp=1")),
    "parallel.bucket_mb": (Acts(0.001, "train:calls:all_reduce", DP2),
                           Refused({"parallel.zero": 3, "parallel.bucket_mb": 1}, "ZeRO-3 (parallel.zero=3)")),
    "parallel.backend": (Refused({"parallel.backend": "nccl"}, "no GPU is visible"),),
    "parallel.timeout_s": (Acts(7.5, "launch:pg_timeout"),),
    "comm.algorithm": (Acts("ring", "train:metric:comm_sent_bytes", DP2),
                       Refused({"parallel.zero": 1, "comm.algorithm": "auto"}, "use comm.algorithm='native'"),
                       Refused({"comm.compression": "int8", "comm.algorithm": "tree"}, "'native' (the backend's)")),
    "comm.compression": (Acts("fp16", "train:metric:dp_sent_bytes", DP2),
                         Refused({"parallel.zero": 2, "comm.compression": "int8"}, "parallel.zero_quant_grads")),
    "comm.topk_ratio": (Acts(0.5, "train:metric:dp_sent_bytes", {**DP2, "comm.compression": "topk"}),
                        Refused({"comm.topk_ratio": 0.1}, "but comm.compression='none'")),
    "comm.node_size": (Acts(1, "train:calls:isend", {**DP2, "comm.algorithm": "hierarchical"}),
                       Refused({"comm.node_size": 2}, "but comm.algorithm='native'")),
    "comm.timeout_s": (Acts(0.3, "collective:outcome", {"comm.algorithm": "ring"}),
                       Refused({"comm.timeout_s": 30}, "comm.algorithm='native' runs the backend's"),
                       Refused({"parallel.zero": 3, "comm.algorithm": "native", "comm.timeout_s": 30},
                               "ZeRO (parallel.zero=3) runs the backend's")),
    # the parameter server: its workers' measurements
    "ps.servers": (Acts(1, "train:files", DP2),
                   Refused({"ps.servers": 2}, "leaves no worker among the 2 ranks"),
                   Refused({"ps.servers": 1, "parallel.zero": 1}, "use parallel.zero=0 or ps.servers=0"),
                   Refused({"ps.servers": 1, "model.n_experts": 4, "parallel.ep": 2},
                           "use parallel.ep=1 or ps.servers=0")),
    "ps.consistency": (Acts("asp", "train:metric:ps_staleness", PS3),
                       Refused({"ps.consistency": "asp"}, "ps.servers=0"),
                       Refused({"ps.servers": 1, "ps.consistency": "asp", "model.n_experts": 4,
                                "model.moe_router": "sigmoid_bias"}, "the workers agree on only in lock-step")),
    "ps.staleness": (Acts(1, "train:metric:ps_staleness", {**PS3, "ps.consistency": "ssp"}),
                     Refused({"ps.servers": 1, "ps.staleness": 2}, "but ps.consistency='bsp'"),
                     Refused({"ps.servers": 1, "ps.consistency": "ssp", "ps.staleness": -1}, "non-negative")),
    "ps.partition_kb": (Acts(1, "train:calls:isend", PS),  # more, smaller partitions
                        Refused({"ps.partition_kb": 64}, "ps.servers=0")),
    "ps.scheduling": (Acts("priority", "train:metric:ps_pull_lazy_waits", PS),  # pulls wait per partition
                      Refused({"ps.scheduling": "priority"}, "ps.servers=0")),
    "ps.credit_kb": (Acts(1, "train:metric:ps_push_started_on_completion", {**PS, "ps.scheduling": "priority"}),
                     Refused({"ps.servers": 1, "ps.credit_kb": 64}, "but ps.scheduling='fifo'")),
    "ps.straggler": (Acts("1:200", "train:metric:ps_staleness", {**PS3, "ps.consistency": "ssp", "ps.staleness": 1},
                          base="0:200"),
                     Refused({"ps.straggler": "1:100"}, "ps.servers=0"),
                     Refused({"ps.servers": 1, "ps.straggler": "1:100"}, "which is not a worker"),
                     Refused({"ps.servers": 1, "ps.straggler": "slow"}, "use 'RANK:MS'")),
    # checkpoints and the run
    "ckpt.every": (Acts(1, "train:files"),),
    "ckpt.keep": (Acts(1, "train:files", {"ckpt.every": 1}),),
    "ckpt.resume": (Acts(True, "train:losses", {"ckpt.every": 1}, also={"probe.prior": 1}),),  # on from step 1
    "ckpt.async": (Acts(True, "train:calls:all_gather", {"ckpt.every": 1}),  # its writers meet by files
                   Refused({"ckpt.async": True, "ps.servers": 1}, "the parameter server's checkpoints")),
    "run.dir": (Acts("{tmp}/b", "launch:files", base="{tmp}/a"),),
    "run.device": (Acts("cpu", "launch:nproc_per_node", {"probe.gpus": 4, "parallel.nproc": UNSET}),),
    "run.progress": (Acts(True, "train:stdout_has:━", {"probe.tty": True}),),  # the bar, on a terminal
    "run.tensorboard": (Acts(True, "train:files"),),
    "run.max_restarts": (Acts(1, "launch:spawned"),),
    "run.fault": (Acts("raise@1:r0", "train:error"), Refused({"run.fault": "kill@3:r5"}, "rank 5 does not exist")),
}
"""How each field is proven to act: an observed difference where it acts (``Acts``), and for a field read only
in some layouts, its refusal in a layout that would not read it (``Refused``). A new field needs an entry: pick
the observer of tests/field_probes.py that sees where it acts (the model, the data, the trainer's losses,
weights, metrics, files or calls, the launcher) and a value that must change it."""

HOW_TO_ADD = ("add it to PROOFS in tests/test_config_fields.py: Acts(VALUE, 'OBSERVER:ASPECT', context) -- a value "
              "that must change what an observer of tests/field_probes.py sees (model:output, train:weights, "
              "train:metric:KEY, train:files, launch:nproc_per_node, ...) -- and, for a field read only in some "
              "layouts, Refused(overrides, fragment) where it is not read")


def test_every_field_has_a_proof():
    missing = [d for d in all_fields() if d not in PROOFS]
    assert not missing, f"{', '.join(missing)}: no proof; {HOW_TO_ADD}"
    assert not set(PROOFS) - set(all_fields()), "PROOFS names fields the tree no longer has"


def test_conditional_fields_are_refused_where_they_do_nothing():
    """A field documented as "With X: ..." is read only when X holds: it needs a refusal where X does not."""
    docs = field_docs()
    assert set(docs) == set(all_fields())
    conditional = [d for d, doc in docs.items() if doc.startswith("With ")]
    assert len(conditional) > 10
    for dotted in conditional:
        assert any(isinstance(p, Refused) for p in PROOFS.get(dotted, ())), f"{dotted} is never refused"


def same(a, b) -> bool:
    """Equal observations: tensors bit for bit, containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class Observations:
    """Every observation the proofs need, each computed once; the trainer's runs all at once per world size."""

    def __init__(self, root: Path, cache: Path):
        self.root, self.cache, self.seen, self.count = root, cache, {}, 0
        corpus = root / "corpus"
        corpus.mkdir()
        (corpus / "docs.txt").write_text("def f(x):\n    return x + 1\n" * 200)
        rows = [{"text": f"row {i} " * 20, "body": f"other {i} " * 30} for i in range(60)]
        (corpus / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        labelled = [{"text": f"document {i} " * 5, "label": i % 2, "y": 1 - i % 2} for i in range(60)]
        (corpus / "labelled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labelled))
        (corpus / "tokenizer.json").write_text(_tiny_bpe_json())
        self.paths = {"{corpus}": corpus, "{cache}": cache, "{hf}": self._hf_directory(root / "hf")}

    def _hf_directory(self, path: Path) -> Path:
        """The base model's shape with other weights, exported as a transformers directory (config.json and
        safetensors): what model.init_from starts from."""
        from shardwise.data.tokenizer import ByteTokenizer
        from shardwise.hf.export import export_model
        from shardwise.model import Transformer

        cfg = config_resolve.resolve(Config.load(overrides=field_probes.texts(field_probes.MODEL)),
                                     tokenizer_vocab=257)
        model = Transformer(cfg.model)
        model.reset_parameters(seed=12345)
        export_model(model.state_dict(), cfg.model, ByteTokenizer(), path)
        return path

    def key(self, observer: str, overrides: dict) -> tuple:
        return observer, tuple(sorted((k, repr(v)) for k, v in overrides.items()))

    def fresh(self) -> dict[str, Path]:
        self.count += 1
        tmp = self.root / f"p{self.count}"
        tmp.mkdir()
        return {**self.paths, "{tmp}": tmp}

    def get(self, observer: str, overrides: dict):
        key = self.key(observer, overrides)
        if key not in self.seen:
            if observer == "train":
                self._all_train_jobs()
            elif observer == "data":
                self.seen[key] = field_probes.observe_data(overrides, self.fresh())
            else:
                self.seen[key] = getattr(field_probes, f"observe_{observer}")(overrides, self.fresh())
        return self.seen[key]

    def _all_train_jobs(self) -> None:
        jobs = {}
        for dotted, proofs in PROOFS.items():
            for proof in proofs:
                if isinstance(proof, Acts) and proof.aspect.startswith("train:"):
                    for overrides in proof.runs(dotted):
                        key = self.key("train", overrides)
                        if key not in self.seen and key not in jobs:
                            jobs[key] = (overrides, self.fresh())
        self.seen.update(field_probes.run_train_jobs(jobs))


def _tiny_bpe_json() -> str:
    """A tokenizer.json of a few merges (data.tokenizer as a path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator(["def f(x): return x + 1"] * 10, trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def observations(tmp_path_factory, cache_dir) -> Observations:
    return Observations(tmp_path_factory.mktemp("fields"), cache_dir)


def aspect_of(seen: dict, aspect: str):
    observer, _, what = aspect.partition(":")
    if observer == "train":
        return field_probes.train_aspect(seen, what)
    if "refused" in seen:
        return ("refused", seen["refused"])
    return seen.get(what)


@pytest.mark.parametrize("dotted", all_fields())
def test_field_acts_or_is_refused(dotted, observations):
    proofs = PROOFS.get(dotted)
    if proofs is None:
        pytest.fail(f"{dotted} has no proof; {HOW_TO_ADD}")
    acts = [p for p in proofs if isinstance(p, Acts)]
    if dotted in ONLY_REFUSED:
        assert not acts and proofs, f"{dotted} is listed as only refused; it needs a Refused proof and no Acts"
    else:
        assert acts, f"{dotted}: nothing shows it changes anything; {HOW_TO_ADD}"
    for proof in proofs:
        if isinstance(proof, Acts):
            observer = proof.aspect.partition(":")[0]
            base, changed = proof.runs(dotted)
            before = aspect_of(observations.get(observer, base), proof.aspect)
            after = aspect_of(observations.get(observer, changed), proof.aspect)
            for run, seen in (("base", before), ("changed", after)):
                assert not (isinstance(seen, tuple) and seen[:1] == ("refused",)), \
                    f"{dotted}: the {run} run of {proof} was refused: {seen[1]}"
            assert not same(before, after), (
                f"{dotted}: set to {proof.value!r} (from {'its default' if proof.base is DEFAULT else repr(proof.base)}"
                f"{f', with {proof.context}' if proof.context else ''}), nothing changed in {proof.aspect} "
                f"({before!r:.200}): the field is read and ignored, or the proof looks in the wrong place")
        else:
            assert dotted in proof.overrides, "a refusal proves something about its own field"
            with pytest.raises(ConfigError) as e:
                resolve(proof.overrides)
            message = str(e.value)
            assert message.startswith((f"{dotted}=", f"{dotted}*")) and "\n" not in message, message
            assert proof.fragment in message, message
            resolve({k: v for k, v in proof.overrides.items() if k != dotted})  # the same layout without it


def test_refusal_on_the_command_line_names_the_field(capsys):
    assert main(["config", "show", "--parallel.microbatches", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: parallel.microbatches=4 counts a pipeline's micro-batches, but parallel.pp=1; "
        "use train.grad_accum=4 for micro-batches accumulated per step")
