"""``shardwise plan``: parameters, FLOPs, memory, communication and time for a config on a cluster.

Takes the same config tree and ``--section.key VALUE`` overrides as ``shardwise train``. Layout
fields the config and the overrides leave open (parallel.dp/tp/pp/cp/ep/zero/sequence_parallel,
train.micro_batch/recompute) are searched; the ones given are kept. Mixture of experts: the model's
``model.n_experts`` / ``moe_top_k`` / ``moe_every`` / ``moe_shared`` (e.g. ``--model.preset mixtral-8x7b``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tomllib

from shardwise.config import Config, ConfigError
from shardwise.plan import report
from shardwise.plan.flops import flops_per_token, gpus_needed, six_nd, training_days
from shardwise.plan.hardware import Cluster, find_gpu, load_catalogue
from shardwise.plan.memory import STATE_CONVENTIONS, parse_state_dtypes
from shardwise.plan.params import closed_form_params, count_params
from shardwise.plan.search import search
from shardwise.plan.spec import OFFLOAD, RECOMPUTE, model_spec, resolved_model, seq_len_of

LAYOUT_KEYS = {
    "parallel.dp": "dp", "parallel.tp": "tp", "parallel.pp": "pp", "parallel.cp": "cp", "parallel.ep": "ep",
    "parallel.zero": "zero", "parallel.offload": "offload", "parallel.sequence_parallel": "sequence_parallel",
    "parallel.pp_virtual": "pp_virtual", "parallel.pp_embedding_slot": "pp_embedding_slot",
    "parallel.pp_head_slot": "pp_head_slot", "train.micro_batch": "micro_batch", "train.grad_accum": "grad_accum",
    "parallel.microbatches": "grad_accum", "train.recompute": "recompute",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise plan", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="TOML config file (the same as for shardwise train)")
    p.add_argument("--gpu", default="H100", help="GPU type from the catalogue (default H100)")
    p.add_argument("--gpus-per-node", type=int, help="default parallel.nproc if set, else 8")
    p.add_argument("--nodes", type=int, help="default parallel.nnodes")
    p.add_argument("--hardware", help="TOML file adding/overriding [gpu.NAME] entries")
    p.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak FLOP/s reached (default 0.5)")
    p.add_argument("--overlap", type=float, default=1.0, help="fraction of compute comm can hide behind")
    p.add_argument("--call-latency-us", type=float, default=0.0,
                   help="measured cost of one collective call between compute bursts, added per call (default 0)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="the trainer's backend: gloo runs ZeRO's collectives as pairwise exchanges (default nccl)")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="usable fraction of GPU memory")
    p.add_argument("--states", default="shardwise",
                   help=f"model-state dtypes: {', '.join(STATE_CONVENTIONS)} or weights=..,grads=..,master=..,"
                        "momentum=..,variance=..")
    p.add_argument("--attention", choices=("flash", "eager"), default="flash",
                   help="activations of fused (flash) or eager attention (Korthikanti's Table 2 is eager)")
    p.add_argument("--tokens", type=float, help="token budget: report training days")
    p.add_argument("--days", type=float, help="time budget: report the GPUs needed")
    p.add_argument("--top", type=int, default=5, help="layouts to show")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", type=Path, help="write a stacked memory bar chart (PNG) of the top layouts")
    p.add_argument("--compare", type=Path, metavar="RUN_DIR", help="set a run's measured metrics beside the plan")
    p.add_argument("--simulate-top", type=int, default=0, metavar="K",
                   help="re-rank the best K layouts by their simulated step (shardwise simulate; the [sim] table of "
                        "--hardware)")
    return p


STORE_TRUE = ("--json",)


def planner_flags(overrides: dict[str, str]) -> list[str]:
    """Turn ``--plan.KEY VALUE`` / ``--cluster.KEY VALUE`` overrides into this parser's flags
    (``--cluster.gpus_per_node 8`` -> ``--gpus-per-node 8``, ``--plan.json`` -> ``--json``), so every
    option can also be given in the dotted form and in a config file's [plan]/[cluster] tables."""
    argv = []
    for key in [k for k in overrides if k.partition(".")[0] in ("plan", "cluster")]:
        value = overrides.pop(key)
        flag = "--" + key.partition(".")[2].replace("_", "-")
        if flag in STORE_TRUE:
            if str(value).lower() in ("true", "1", "yes"):
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _read_toml(path: str | None) -> dict:
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def _file_flags(config: str | None) -> list[str]:
    """Planner options from the [plan] and [cluster] tables of the config file (if one is given)."""
    tree = _read_toml(config)
    flat = {f"{sec}.{k}": str(v).lower() if isinstance(v, bool) else str(v)
            for sec in ("plan", "cluster") for k, v in tree.get(sec, {}).items()}
    return planner_flags(flat)


def main(argv: list[str], overrides: dict[str, str]) -> int:
    overrides = dict(overrides)
    parser = build_parser()
    config = parser.parse_args(list(argv)).config
    args = parser.parse_args(_file_flags(config) + planner_flags(overrides) + list(argv))
    try:
        return _run(args, overrides)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None


def _given_keys(path: str | None, overrides: dict[str, str]) -> set[str]:
    keys = set(overrides)
    if path and Path(path).is_file():
        try:
            tree = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError:
            tree = {}
        keys |= {f"{s}.{k}" for s, vals in tree.items() if isinstance(vals, dict) for k in vals}
    return keys


def load_plan_inputs(config: str | None, overrides: dict[str, str]):
    """(Config, ModelSpec, seq_len, fixed layout fields, global batch or None)."""
    tree = _read_toml(config)
    for section in ("plan", "cluster"):
        tree.pop(section, None)
    cfg = Config.from_dict(tree)
    for dotted, text in overrides.items():
        cfg.set_text(dotted, text)
    given = _given_keys(config, overrides)
    cfg.model = resolved_model(cfg)  # the name too: a shape given without a preset is "custom"
    m = model_spec(cfg)
    s = seq_len_of(cfg, m)
    fixed = {}
    for key, field_name in LAYOUT_KEYS.items():
        if key in given:
            section, _, name = key.partition(".")
            value = getattr(getattr(cfg, section), name)
            if value is not None:
                fixed[field_name] = value
    if fixed.get("recompute", "none") not in RECOMPUTE:
        raise ConfigError(f"train.recompute={fixed['recompute']!r}; the planner knows {', '.join(RECOMPUTE)}")
    if fixed.get("offload", "none") not in OFFLOAD:
        raise ConfigError(f"parallel.offload={fixed['offload']!r}; the planner knows {', '.join(OFFLOAD)}")
    if fixed.get("zero", 0) not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={fixed['zero']}; use 0, 1, 2 or 3")
    for k in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "grad_accum", "pp_virtual"):
        if k in fixed and fixed[k] < 1:
            raise ConfigError(f"{k}={fixed[k]} must be a positive integer")
    batch_given = "train.global_batch" in given
    derived = "micro_batch" in fixed and "grad_accum" in fixed
    global_batch = cfg.train.global_batch if (batch_given or not derived) else None
    return cfg, m, s, fixed, global_batch


def _run(args, overrides: dict[str, str]) -> int:
    cfg, m, s, fixed, global_batch = load_plan_inputs(args.config, overrides)
    if args.compare:
        from shardwise.plan.compare import compare_run

        return compare_run(args.compare, as_json=args.json, gpu=args.gpu, hardware=args.hardware,
                           efficiency=args.efficiency)
    catalogue = load_catalogue(args.hardware)
    gpu = find_gpu(args.gpu, catalogue)
    gpn = args.gpus_per_node if args.gpus_per_node is not None else (cfg.parallel.nproc or 8)
    nodes = args.nodes if args.nodes is not None else cfg.parallel.nnodes
    for flag, value in (("--gpus-per-node (cluster.gpus_per_node)", gpn), ("--nodes (cluster.nodes)", nodes)):
        if value < 1:  # 0 is not "the default": say so rather than plan another cluster
            raise ConfigError(f"{flag}={value} must be a positive integer")
    if not 0 < args.efficiency <= 1 or not 0 <= args.overlap <= 1 or not 0 < args.memory_fraction <= 1:
        raise ConfigError("--efficiency and --memory-fraction must be in (0, 1], --overlap in [0, 1]")
    if args.call_latency_us < 0:
        raise ConfigError(f"--call-latency-us={args.call_latency_us} must be >= 0")
    cluster = Cluster(gpu, gpn, nodes, args.efficiency, args.overlap, args.call_latency_us * 1e-6, args.backend)
    states = parse_state_dtypes(args.states)
    precision = cfg.train.precision
    result = search(m, s, cluster, fixed, global_batch, states, precision, args.attention, args.memory_fraction,
                    top=args.top, bucket_mb=cfg.parallel.bucket_mb,
                    zero_unit=cfg.parallel.zero_unit, zero_hpz=cfg.parallel.zero_hpz)
    params = count_params(m)
    fpt = flops_per_token(m, s)
    peak = gpu.peak(precision)
    training = {}
    if args.tokens:
        training["tokens"] = args.tokens
        training["total_flops_6ND"] = six_nd(params.active, args.tokens)
        training["total_flops"] = fpt * args.tokens
        if result.ranked:
            best = result.ranked[0].time
            training["days"] = args.tokens / best.tokens_per_s / 86400
        training["days_at_efficiency_6ND"] = training_days(params.active, args.tokens, peak, cluster.world,
                                                            args.efficiency)
        if args.days:
            training["days_budget"] = args.days
            training["gpus_needed_6ND"] = gpus_needed(params.active, args.tokens, peak, args.days, args.efficiency)
    doc = {
        "model": {"preset": cfg.model.preset, **{k: getattr(m, k) for k in m.__dataclass_fields__}},
        "seq_len": s, "global_batch": global_batch, "precision": precision, "states": args.states,
        "parameters": params.as_dict(),
        "closed_form_parameters": closed_form_params(m.n_layers, m.d_model, m.vocab_size, m.max_seq_len),
        "flops_per_token": fpt, "flops_per_token_6N": 6.0 * params.active,
        "cluster": {"gpu": gpu.name, "gpus_per_node": gpn, "nodes": nodes, "world": cluster.world,
                    "peak_flops": peak, "memory_bytes": gpu.memory_bytes, "efficiency": args.efficiency},
        "fixed": fixed, "considered": result.considered, "fitting": result.fitting,
        "dropped": dict(result.dropped), "dropped_examples": result.examples,
        "layouts": [report.candidate_dict(c) | {"fits": True} for c in result.ranked],
        "training": training,
    }
    unfit = _only_layout_over_budget(result)
    if unfit is not None:  # the config leaves one layout: show it whole, so the user sees what to change
        doc["layouts"] = [report.candidate_dict(unfit) | {"fits": False, "budget_bytes": result.budget_bytes}]
    shown = result.ranked or ([unfit] if unfit is not None else [])
    if args.plot and shown:
        report.plot_memory(shown, args.plot, f"{cfg.model.preset} on {cluster.world} x {gpu.name}",
                           capacity=gpu.memory_bytes)
    lines = _text(doc, result, args, unfit)
    if args.simulate_top > 0 and result.ranked:
        from shardwise.sim.hardware import build_hardware
        from shardwise.sim.planning import rerank_lines, simulate_best

        hw = build_hardware(args.gpu, nodes, gpn, args.hardware)
        top, simulated = simulate_best(args.config, overrides, result.ranked, hw, args.simulate_top,
                                       cfg.parallel.pp_schedule)
        for entry, sim in zip(doc["layouts"], simulated, strict=False):
            entry["simulated"] = sim
        lines += [""] + rerank_lines(top, simulated)
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print("\n".join(lines))
    if unfit is not None:
        print(f"error: {unfit.layout.short()} {report.does_not_fit(unfit, result.budget_bytes, gpu.memory_bytes)}",
              file=sys.stderr)
        return 3
    if not result.ranked:
        print("error: no layout fits; see the reasons above", file=sys.stderr)
        return 3
    return 0


def _only_layout_over_budget(result):
    """The one layout the config leaves (every other choice fixed or ruled out), when it does not fit."""
    return result.smallest_over_budget if not result.ranked and result.over_budget == 1 else None


def _text(doc, result, args, unfit=None) -> list[str]:
    p, m = doc["parameters"], doc["model"]
    c = doc["cluster"]
    out = [
        f"model {m['preset']} ({m['flavor']}, L={m['n_layers']} h={m['d_model']} heads={m['n_heads']}/"
        f"{m['n_kv_heads']} ff={m['d_ff']} V={m['vocab_size']}): {report.human(p['total'])} parameters "
        f"(embedding {report.human(p['embedding'] + p['position'])}, attention {report.human(p['attention'])}, "
        f"mlp {report.human(p['mlp'])}, norms {report.human(p['norms'])}, head {report.human(p['head'])}"
        + (f", active {report.human(p['active'])}" if p["active"] != p["total"] else "") + ")",
        f"  closed form 12Lh²(1 + 13/12h + (V+s)/12Lh) = {report.human(doc['closed_form_parameters'])}"
        " (Narayanan et al. 2021; GPT-style models only)",
        f"FLOPs per token {report.human(doc['flops_per_token'])} = 6N + 12·L·h·s (PaLM App. B; 6N alone "
        f"{report.human(doc['flops_per_token_6N'])}); seq_len {doc['seq_len']}, global batch {doc['global_batch']}, "
        f"{doc['precision']}, states '{doc['states']}'",
        f"cluster {c['world']} x {c['gpu']} ({c['nodes']} node(s) x {c['gpus_per_node']}): peak "
        f"{report.human(c['peak_flops'], 'FLOP/s')}, {c['memory_bytes'] / 1e9:.0f} GB, "
        f"efficiency {c['efficiency']:.0%}",
        f"fixed by the config: {doc['fixed'] or 'nothing'}; searched {doc['considered']} layouts, "
        f"{doc['fitting']} fit",
        "",
    ]
    if result.ranked:
        out += report.layouts_table(result.ranked)
        out += [""] + report.breakdown(result.ranked[0])
    elif unfit is not None:
        out += report.layouts_table([unfit])
        out += [""] + report.breakdown(unfit, report.does_not_fit(unfit, result.budget_bytes, c["memory_bytes"]))
    if result.dropped:
        out += ["", "dropped:"]
        for reason, n in result.dropped.most_common():
            out.append(f"  {n:>6} x {reason} (e.g. {result.examples[reason]})")
    t = doc["training"]
    if t:
        out.append("")
        if "days" in t:
            out.append(f"{t['tokens']:.3g} tokens at the best layout's {result.ranked[0].time.tokens_per_s:,.0f} "
                       f"tokens/s: {t['days']:.1f} days on {c['world']} GPUs")
        out.append(f"6·N·D = {t['total_flops_6ND']:.3g} FLOPs: {t['days_at_efficiency_6ND']:.1f} days on "
                   f"{c['world']} GPUs at {c['efficiency']:.0%} of peak")
        if "gpus_needed_6ND" in t:
            out.append(f"GPUs needed for {t['days_budget']:g} days: 6·N·D / (peak · {c['efficiency']:.0%} · time)"
                       f" = {t['gpus_needed_6ND']:,.0f}")
    return out
