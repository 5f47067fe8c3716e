"""Planning the released models from their config.json alone: the parameter counts equal the published ones to the
precision they were printed with, and `shardwise plan` / `simulate` take a directory that holds nothing but a
config.json (a 405B or 671B model is planned before anything is downloaded)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from shardwise.cli import main
from shardwise.config import ModelConfig
from shardwise.hf.config_map import model_fields
from shardwise.plan.params import count_params
from shardwise.plan.spec import ModelSpec, architecture_of
from tests.released_configs import RELEASED

PUBLISHED = {
    # the released checkpoints' own counts (their safetensors), as the Hub prints them; Meta's cards name the
    # sizes "8B", "70B", "405B"
    "Llama-3.1-8B": {"total": "8.03B"}, "Llama-3.1-70B": {"total": "70.6B"}, "Llama-3.1-405B": {"total": "406B"},
    # Qwen's model cards ("Number of Parameters (Non-Embedding)" leaves out the token table and the output head)
    "Qwen3-0.6B": {"total": "0.6B", "qwen_non_embedding": "0.44B"},
    "Qwen3-8B": {"total": "8.2B", "qwen_non_embedding": "6.95B"},
    "Qwen3-32B": {"total": "32.8B", "qwen_non_embedding": "31.2B"},
    "Qwen3-30B-A3B": {"total": "30.5B", "active": "3.3B", "qwen_non_embedding": "29.9B"},
    "Qwen3-235B-A22B": {"total": "235B", "active": "22B", "qwen_non_embedding": "234B"},
    "Qwen2.5-7B": {"total": "7.61B", "qwen_non_embedding": "6.53B"},
    # the Hub's count of the released checkpoint (Mistral's announcement says "7.3B")
    "Mistral-7B-v0.1": {"total": "7.24B"},
    # Gemma 2 report, Table 1: non-embedding parameters to the unit (its embedding counts 256,128 rows)
    "gemma-2-2b": {"non_embedding": "2024517888"}, "gemma-2-9b": {"non_embedding": "8324201984"},
    "gemma-2-27b": {"non_embedding": "26047480320"},
    # Gemma 3 report, Table 1, in millions (the language model; 27B's vision encoder is not in its text config)
    "gemma-3-1b": {"embedding": "302M", "non_embedding": "698M"}, "gemma-3-27b (text)": {"non_embedding": "25600M"},
    "Phi-3-mini-4k": {"total": "3.8B"},  # Abdin et al. 2024, "Phi-3 Technical Report", §2
    "OLMo-2-1124-7B": {"total": "7.3B"},  # the Hub's count of the released checkpoint
    "DeepSeek-V3": {"total": "671B", "active": "37B"},  # DeepSeek-V3 Technical Report, abstract (without MTP)
}
_UNITS = {"B": 1e9, "M": 1e6, "": 1}


def agrees(value: int, printed: str) -> bool:
    """``value`` printed to the precision of ``printed``, rounded or cut (publishers do both): within half a unit of
    the last printed digit, or at most one unit above it."""
    number, unit = re.fullmatch(r"([\d.]+)([BM]?)", printed).groups()
    decimals = len(number.partition(".")[2])
    step = 10 ** -decimals * _UNITS[unit]
    published = float(number) * _UNITS[unit]
    return abs(value - published) <= step / 2 or 0 <= value - published < step


def spec_of(hf: dict) -> ModelSpec:
    m = dataclasses.replace(ModelConfig(), **model_fields(hf))
    return ModelSpec(flavor=m.flavor, n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
                     n_kv_heads=m.n_kv_heads, d_ff=m.d_ff, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len,
                     tie_embeddings=m.tie_embeddings, n_experts=m.n_experts, moe_top_k=m.moe_top_k,
                     moe_every=m.moe_every, moe_shared=m.moe_shared, moe_d_ff=m.moe_d_ff, qk_norm=m.qk_norm,
                     **architecture_of(m))


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_count_is_the_published_one(name):
    c = count_params(spec_of(RELEASED[name]))
    counts = {"total": c.total, "active": c.active, "embedding": c.embedding, "non_embedding": c.total - c.embedding,
              "qwen_non_embedding": c.total - c.embedding - c.head}
    for what, printed in PUBLISHED[name].items():
        assert agrees(counts[what], printed), f"{name} {what}: {counts[what]:,} is not {printed}"


def test_parameter_count_is_the_model_we_build():
    """The planner's count is the built model's (tiny versions of each architecture, on the meta device)."""
    import torch

    from shardwise.model import Transformer

    for name in ("Qwen3-30B-A3B", "gemma-3-27b (text)", "DeepSeek-V3", "Qwen2.5-7B", "OLMo-2-1124-7B"):
        hf = {**RELEASED[name], "num_hidden_layers": 4, "first_k_dense_replace": 1}
        fields = model_fields(hf)
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(ModelConfig(), **fields))
        assert count_params(spec_of(hf)).total == model.num_parameters(), name


def test_plan_and_simulate_take_a_directory_with_only_config_json(tmp_path, capsys):
    """`shardwise plan` on Llama-3.1-405B and DeepSeek-V3 (671B) with nothing downloaded but config.json, and one
    simulated step; training from such a directory is refused in one line (no weights)."""
    dirs = {}
    for name in ("Llama-3.1-405B", "DeepSeek-V3"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text(json.dumps(RELEASED[name]))
    layouts = {"Llama-3.1-405B": ["--nodes", "32", "--data.seq_len", "8192", "--parallel.tp", "8"],
               "DeepSeek-V3": ["--nodes", "128", "--train.global_batch", "1024", "--parallel.tp", "4",
                               "--parallel.cp", "4", "--parallel.ep", "64", "--parallel.zero", "3",
                               "--parallel.sequence_parallel", "true", "--parallel.cp_algorithm", "allgather",
                               "--train.recompute", "full"]}
    for name, path in dirs.items():
        argv = ["--model.init_from", f"hf:{path}", "--data.seq_len", "4096", *layouts[name]]
        assert main(["plan", *argv, "--top", "1", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        c = count_params(spec_of(RELEASED[name]))
        assert (report["parameters"]["total"], report["parameters"]["active"]) == (c.total, c.active)
    assert main(["simulate", "--model.init_from", f"hf:{dirs['DeepSeek-V3']}", "--data.seq_len", "4096",
                 *layouts["DeepSeek-V3"], "--train.precision", "bf16"]) == 0
    assert "step " in capsys.readouterr().out
    assert main(["train", "--model.init_from", f"hf:{dirs['DeepSeek-V3']}"]) == 2
    assert "holds no model.safetensors" in capsys.readouterr().err
