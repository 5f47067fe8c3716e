"""``shardwise plan``: table, JSON, plot, compare and bad input."""

from __future__ import annotations

import json

import pytest

from shardwise.cli import main as shardwise_main
from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.plan.cli import main


def run(capsys, argv, overrides):
    rc = main(argv, overrides)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_searches_open_fields(capsys):
    rc, out, _ = run(capsys, ["--gpus-per-node", "8", "--nodes", "1", "--top", "3"],
                     {"model.preset": "gpt2-124m", "train.global_batch": "64", "parallel.tp": "2"})
    assert rc == 0
    assert "124.44M parameters" in out and "fixed by the config: {'tp': 2}" in out
    assert "mem_params_bytes" in out and "Korthikanti" in out and "step time" in out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 3 and all("tp2" in r for r in rows)


def test_json_and_dotted_planner_flags(capsys):
    rc, out, _ = run(capsys, [], {"model.preset": "gpt3-175b", "train.global_batch": "1536", "parallel.tp": "8",
                                  "parallel.pp": "8", "train.micro_batch": "1", "train.recompute": "full",
                                  "cluster.gpu": "A100", "cluster.nodes": "128", "plan.states": "mixed",
                                  "plan.tokens": "300e9", "plan.days": "30", "plan.json": "true"})
    assert rc == 0
    doc = json.loads(out)
    assert doc["cluster"]["world"] == 1024 and doc["cluster"]["gpu"] == "A100-80GB"
    best = doc["layouts"][0]
    assert best["layout"]["tp"] == 8 and best["layout"]["pp"] == 8 and best["layout"]["dp"] == 16
    assert set(best["memory"]) >= {"mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_total_bytes",
                                   "mem_activations_bytes", "mem_device_bytes"}
    assert {"tokens_per_s", "step_time_s", "mfu", "comm_bytes"} <= set(best["time"])
    assert doc["training"]["gpus_needed_6ND"] > 0 and doc["training"]["days"] > 0
    # ZeRO-2/3 inside the pipeline are searched too, with the stage's unsharded gradients held to the flush
    assert {c["layout"]["zero"] for c in doc["layouts"]} >= {1, 2, 3}
    z3 = next(c for c in doc["layouts"] if c["layout"]["zero"] == 3)
    assert z3["memory"]["mem_grad_accum_bytes"] == z3["memory"]["mem_gathered_bytes"] > 0


def test_plot(capsys, tmp_path):
    png = tmp_path / "mem.png"
    rc, _, _ = run(capsys, ["--plot", str(png), "--top", "3"], {"model.preset": "cpu-demo", "parallel.nproc": "2"})
    assert rc == 0 and png.stat().st_size > 1000


def test_no_layout_fits(capsys):
    rc, out, err = run(capsys, ["--gpu", "V100", "--gpus-per-node", "1"], {"model.preset": "gpt3-175b"})
    assert rc == 3 and "does not fit" in out and "no layout fits" in err


@pytest.mark.parametrize("argv,overrides,match", [
    (["--gpu", "Z80"], {}, "unknown GPU"),
    ([], {"parallel.zero": "4"}, "parallel.zero=4"),
    ([], {"train.recompute": "some"}, "train.recompute"),
    ([], {"model.n_heads": "5", "model.preset": "tiny"}, "does not divide"),
    (["--states", "weights=int3"], {}, "--states"),
])
def test_bad_input(argv, overrides, match):
    with pytest.raises(ConfigError, match=match):
        main(argv, overrides)


def test_through_shardwise_cli(capsys):
    assert shardwise_main(["plan", "--model.preset", "tiny", "--parallel.nproc", "2", "--plan.top", "2"]) == 0
    assert "layout" in capsys.readouterr().out
    assert shardwise_main(["plan", "--model.preset", "tiny", "--parallel.zero", "9"]) == 2


def test_compare(capsys, tmp_path):
    cfg = Config.load(overrides={"model.preset": "tiny", "parallel.nproc": "2", "train.global_batch": "8"})
    resolved = resolve(cfg, tokenizer_vocab=257)
    (tmp_path / "config.toml").write_text(resolved.to_toml())
    records = [{"step": i, "loss": 3.0, "tokens_per_s": 1000.0 + i, "step_time_s": 0.5, "mfu": 0.01,
                "comm_bytes": 4.0 * 109_000} for i in (1, 2, 3)]
    records[-1]["mem_peak_rss_bytes"] = 5e8
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rc, out, _ = run(capsys, ["--compare", str(tmp_path), "--json"], {})
    assert rc == 0
    doc = json.loads(out)
    import torch

    from shardwise.model.transformer import Transformer
    with torch.device("meta"):
        n = Transformer(resolved.model).num_parameters()
    assert doc["predicted"]["parameters"] == n
    with torch.device("meta"):
        tensors = len(list(Transformer(resolved.model).parameters()))
    # fp32 gradients plus DataParallel's one fp32 "had a gradient" flag per tensor, one all-reduce per step
    assert doc["predicted"]["comm_bytes"] == 4 * (n + tensors)
    assert doc["measured"]["tokens_per_s"] == 1002.5 and doc["measured"]["mem_peak_rss_bytes"] == 5e8
    assert doc["step_time"]["formula"]["step_time_s"] > 0 and doc["step_time"]["simulated"]["step_time_s"] > 0
    rc, out, _ = run(capsys, ["--compare", str(tmp_path)], {})
    assert "comm_bytes" in out and "mem_optimizer_bytes" in out and "not yet activations" in out
    assert "step_time_s (simulated, H100)" in out


def test_config_file_with_cluster_and_plan_tables(capsys, tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[model]\npreset = "gpt2-124m"\nn_experts = 4\n[train]\nglobal_batch = 32\n[parallel]\nzero = 1\n'
                    '[cluster]\ngpu = "A100-40GB"\nnodes = 2\n[plan]\ntop = 2\njson = true\n')
    rc, out, _ = run(capsys, [str(path), "--hardware", "configs/hardware.toml"], {"cluster.nodes": "1"})
    doc = json.loads(out)
    assert rc == 0 and doc["cluster"]["gpu"] == "A100-40GB" and doc["cluster"]["world"] == 8  # the override wins
    assert doc["fixed"] == {"zero": 1} and len(doc["layouts"]) == 2 and doc["model"]["n_experts"] == 4


def test_a_shape_without_a_preset_is_custom_and_takes_data_seq_len(capsys):
    """No preset named, the shape given: max_seq_len follows data.seq_len (not cpu-demo's 128), and the
    model is called "custom" -- by the planner and by the trainer's resolution alike."""
    shape = {"model.n_layers": "96", "model.d_model": "12288", "model.n_heads": "96", "data.seq_len": "2048"}
    rc, out, err = run(capsys, ["--gpu", "A100", "--nodes", "16", "--top", "1"], dict(shape))
    assert rc == 0, err
    assert out.startswith("model custom (gpt2, L=96 h=12288") and "seq_len 2048" in out
    rc, out, _ = run(capsys, ["--gpu", "A100", "--nodes", "16", "--top", "1", "--json"], dict(shape))
    doc = json.loads(out)
    assert doc["model"]["preset"] == "custom" and doc["model"]["max_seq_len"] == doc["seq_len"] == 2048
    resolved = resolve(Config.load(overrides=shape), world_size=1, tokenizer_vocab=257)
    assert (resolved.model.preset, resolved.model.flavor, resolved.model.max_seq_len) == ("custom", "gpt2", 2048)
    # a resolved config read back stays as it is; the default preset alone, or one field changed, is cpu-demo
    again = resolve(Config.from_dict(resolved.to_dict()), world_size=1, tokenizer_vocab=257)
    assert (again.model.preset, again.model.max_seq_len) == ("custom", 2048)
    for overrides in ({}, {"model.d_model": "512"}):
        cfg = resolve(Config.load(overrides=overrides), world_size=1, tokenizer_vocab=257)
        assert (cfg.model.preset, cfg.model.max_seq_len) == ("cpu-demo", 128)


FIXED_175B = {"model.preset": "gpt3-175b", "parallel.tp": "8", "parallel.pp": "1", "parallel.zero": "0",
              "train.micro_batch": "1", "train.recompute": "full", "parallel.sequence_parallel": "true"}
"""GPT-3 175B on one node of 8 H100s, every layout field fixed: 351.67 GB per GPU, far over 72 GB."""


def test_a_fixed_layout_that_does_not_fit_is_shown_in_full(capsys):
    rc, out, err = run(capsys, [], dict(FIXED_175B))
    assert rc == 3
    assert "memory per GPU of dp1 tp8 pp1 z0 mb1 rc-full sp -- does not fit: needs 351.67 GB of 72.00 GB" in out
    for what in ("mem_params_bytes", "mem_optimizer_bytes", "mem_activations_bytes", "total on device",
                 "communication per step", "reduce-scatter", "step time"):
        assert what in out, what
    assert "does not fit: needs 351.67 GB of 72.00 GB" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = run(capsys, ["--json"], dict(FIXED_175B))
    doc = json.loads(out)
    assert rc == 3 and doc["fitting"] == 0 and len(doc["layouts"]) == 1
    layout = doc["layouts"][0]
    assert layout["fits"] is False and layout["layout"]["tp"] == 8
    assert layout["memory"]["mem_device_bytes"] > layout["budget_bytes"] == 0.9 * 80e9
    assert layout["time"]["step_time_s"] > 0 and layout["comm"]


def test_an_open_layout_that_does_not_fit_lists_the_reasons_only(capsys):
    rc, out, err = run(capsys, ["--json"], {"model.preset": "gpt3-175b", "parallel.tp": "8"})
    doc = json.loads(out)
    assert rc == 3 and doc["layouts"] == [] and "no layout fits" in err
