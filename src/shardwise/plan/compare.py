"""``shardwise plan --compare RUN_DIR``: a run's measured metrics beside the plan's predictions.

Quantities share the trainer's metric names (``tokens_per_s``, ``step_time_s``, ``mfu``,
``comm_bytes``, ``comm_sent_bytes``, ``pp_sent_bytes``, ``mem_{params,grads,master,optimizer,total}_bytes``).
Model-state bytes are compared category by category when the run logged them (the trainer's memory
accountant, shardwise.train.memory); activations and buffers are not measured by the trainer
yet, so the device total is set beside the process's peak RSS, which also holds the
interpreter, torch and the data.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from shardwise.config import Config
from shardwise.plan.comm import comm_items, pipeline_sent_bytes
from shardwise.plan.context import cp_sent_bytes, ring_activation_bytes
from shardwise.plan.flops import flops_per_token
from shardwise.plan.hardware import BUILTIN_GPUS, Cluster
from shardwise.plan.memory import (
    FLUSH_METRICS,
    MEMORY_METRICS,
    MODEL_STATE_METRICS,
    STATE_CONVENTIONS,
    activation_mode,
    exact_zero_units,
    memory_breakdown,
)
from shardwise.plan.params import count_params
from shardwise.plan.spec import Layout, model_spec, seq_len_of
from shardwise.plan.tensors import even_stage_blocks, model_params
from shardwise.train.metrics import read_metrics


def predicted_for_run(cfg: Config) -> dict[str, float]:
    """The plan of the layout a run's resolved config describes (data parallel or ZeRO, fp32 states).

    Model-state bytes are those of rank 0, the rank whose metrics the trainer logs; with ZeRO they
    follow the engine's padded flat units (parallel.bucket_mb, parallel.zero_unit) and, with ZeRO++
    hpZ (parallel.zero_hpz), its secondary partitions.

    With a pipeline, communication is rank 0's too: the planner's "pipeline" item (a middle stage's
    sends, in the compute dtype, for the time model) is replaced by ``pp_sent_bytes``
    (:func:`~shardwise.plan.comm.pipeline_sent_bytes`): rank 0's own sends, in fp32 because the
    trainer's residual stream stays fp32 under autocast, plus the tied table's gradient. The trainer
    adds these bytes to both ``comm_bytes`` and ``comm_sent_bytes`` (point-to-point: payload = sent)."""
    m = model_spec(cfg)
    s = seq_len_of(cfg, m)
    p, t = cfg.parallel, cfg.train
    world = (p.nproc or 1) * p.nnodes
    lay = run_layout(cfg)
    dp = lay.dp
    states = STATE_CONVENTIONS["shardwise"]
    act_bytes = 4 if t.precision == "fp32" else 2
    mode = activation_mode(t.precision, states)
    blocks = _rank0_blocks(cfg)
    first_rank = blocks if p.pp > 1 else None  # a pipeline's ZeRO units are rank 0's stages'
    mem = memory_breakdown(m, lay, s, states, attention="flash", act_mode=mode, bucket_mb=p.bucket_mb,
                           zero_unit=p.zero_unit, zero_hpz=p.zero_hpz, first_rank_blocks=first_rank)
    cluster = Cluster(BUILTIN_GPUS["H100"], gpus_per_node=world)  # placement only; times are not compared
    units = exact_zero_units(m, lay, p.bucket_mb, p.zero_unit, zero_hpz=p.zero_hpz, first_rank_blocks=first_rank)
    # DataParallel's buckets carry one "had a gradient" flag per parameter tensor of the rank's part
    first_stage = ("tok_emb", "pos_emb")  # with pp > 1 rank 0 holds the first stage, never the head
    tensors = sum(1 for e in model_params(m) if e.block in blocks or (e.block is None and (
        p.pp == 1 or e.name.split(".")[0] in first_stage))) if dp * p.cp > 1 else 0
    flags = tensors if p.zero == 0 else 0
    # with experts split over ep, their tensors sit in buckets of their own, reduced over the expert replicas
    ep_flags = sum(".experts." in e.name for e in model_params(m)) if flags and p.ep > 1 else 0
    # ZeRO-1/2 of a MoE model (no exact units): the engine's uint8 flags, one per tensor, over the whole dp group
    zero_flags = tensors if p.zero in (1, 2) and units is None and m.n_experts else 0
    items = [c for c in comm_items(m, lay, s, states, cluster, act_bytes, units,
                                   dp_flags=flags - ep_flags + zero_flags, ep_flags=ep_flags)
             if c.technique not in ("pipeline", "context parallel")]
    p2p = pipeline_sent_bytes(m, lay, s)
    tp = tensor_parallel_bytes(items, lay, s, m.d_model, act_bytes) + tp_grad_sync_bytes(m, lay)
    layers = len(blocks)  # the context-parallel terms are per block this rank holds
    cp = cp_sent_bytes(m, lay, s, p.cp_algorithm, act_bytes, layers=layers)
    out = {"parameters": float(count_params(m).total), "flops_per_token": flops_per_token(m, s),
           "tp_sent_bytes": tp, "cp_sent_bytes": cp,
           "comm_bytes": sum(c.total_payload for c in items if not
                             c.technique.startswith("tensor parallel")) + tp + p2p + cp,
           "comm_sent_bytes": sum(c.sent_bytes for c in items) + p2p, "pp_sent_bytes": p2p,
           "ep_sent_bytes": sum(c.total_payload for c in items if c.technique.startswith("expert parallel")),
           "mem_device_bytes": mem.total()}
    out.update(mem.by_metric())
    if p.cp > 1 and p.cp_algorithm == "ring":  # what the ring keeps; the other algorithms' are not predicted
        out["cp_attn_act_bytes"] = ring_activation_bytes(m, lay, s, act_bytes, layers=layers)
    for k in MODEL_STATE_METRICS:  # the accountant counts offloaded states too, wherever they live
        out[k] = sum(mem.by_metric(where)[k] for where in ("device", "host", "disk"))
    out["mem_grads_bytes"] += flags * 4  # the flags live in the fp32 gradient buckets too
    out["mem_total_bytes"] = sum(out[k] for k in MODEL_STATE_METRICS)
    return out


def run_layout(cfg: Config) -> Layout:
    """The planner's layout of a run's resolved config."""
    p, t = cfg.parallel, cfg.train
    world = (p.nproc or 1) * p.nnodes
    dp = p.dp or max(1, world // (p.tp * p.pp * p.cp))
    return Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, zero=p.zero,
                  offload=p.offload if p.zero else "none", sequence_parallel=p.sequence_parallel,
                  pp_virtual=p.pp_virtual, micro_batch=t.micro_batch or 1,
                  grad_accum=t.grad_accum or 1, recompute=t.recompute)


def step_times(cfg: Config, gpu: str, hardware: str | None, efficiency: float) -> dict[str, dict[str, float]]:
    """The run's step on ``gpu`` (``hardware``: a catalogue file with a [sim] table): the formula's
    (:func:`shardwise.plan.perf.step_time`, at ``efficiency``) and the simulator's (:mod:`shardwise.sim`), on
    the run's nodes and ranks per node."""
    from shardwise.plan.hardware import find_gpu, load_catalogue
    from shardwise.plan.perf import step_time
    from shardwise.sim.hardware import build_hardware
    from shardwise.sim.planning import simulated_for_run

    p = cfg.parallel
    m = model_spec(cfg)
    lay = run_layout(cfg)
    act_bytes = 4 if cfg.train.precision == "fp32" else 2
    cluster = Cluster(find_gpu(gpu, load_catalogue(hardware)), gpus_per_node=p.nproc or 1, nodes=p.nnodes,
                      efficiency=efficiency)
    units = exact_zero_units(m, lay, p.bucket_mb, p.zero_unit, zero_hpz=p.zero_hpz)
    formula = step_time(m, lay, seq_len_of(cfg, m), cluster, STATE_CONVENTIONS["shardwise"], cfg.train.precision,
                        act_bytes, units)
    hw = build_hardware(gpu, p.nnodes, p.nproc or 1, hardware)
    return {"formula": {"step_time_s": formula.step_time_s, "tokens_per_s": formula.tokens_per_s, "mfu": formula.mfu},
            "simulated": simulated_for_run(cfg, hw)}


def _rank0_blocks(cfg: Config) -> set[int]:
    """Blocks global rank 0 holds: all of them, or those of its pipeline chunks c * pp (Narayanan et al. 2021
    §2.2.2) under the planner's even split (:func:`~shardwise.plan.tensors.even_stage_blocks`; a partition
    balanced by parameters or FLOPs, ``parallel.pp_partition``, may cut elsewhere)."""
    p = cfg.parallel
    if p.pp == 1:
        return set(range(cfg.model.n_layers))
    split = even_stage_blocks(cfg.model.n_layers, p.pp * p.pp_virtual, p.pp_embedding_slot, p.pp_head_slot)
    return {b for c in range(p.pp_virtual) for b in split[c * p.pp]}


def tensor_parallel_bytes(items, lay: Layout, s: int, d_model: int, act_bytes: int) -> float:
    """Bytes a tensor-parallel rank hands to its collectives per step, as the trainer does them: the
    planner's four per layer and micro-batch (Shoeybi et al. 2019 §3), plus the vocabulary-parallel
    embedding's exit and the head's entry (one each way; with sequence parallelism a reduce-scatter and
    an all-gather each) and the vocabulary-parallel loss's three all-reduces of one fp32 value per token.
    The parameters' gradient all-reduces are :func:`tp_grad_sync_bytes`."""
    if lay.tp == 1:
        return 0.0
    tokens = lay.micro_batch * (s // lay.cp)  # this rank's share of the sequence under context parallelism
    per_micro = (2 if lay.sequence_parallel else 1) * 2 * tokens * d_model * act_bytes + 3 * tokens * 4
    return sum(c.total_payload for c in items if c.technique.startswith("tensor parallel")) + \
        per_micro * lay.grad_accum


def tp_grad_sync_bytes(m, lay: Layout) -> float:
    """Bytes of the gradient all-reduces tensor parallelism adds per step, one per parameter and backward
    pass (micro-batch), fp32: with sequence parallelism every tensor Megatron leaves whole (norms,
    row-parallel biases, the position table) has a partial gradient summed over tp (Korthikanti et al.
    2022 §4.2.2); where tp > n_kv_heads the replicated key/value projections' gradients are summed at their
    full size; of a MoE block's experts, this rank's 1/ep -- with ``etp`` only their second bias (the split
    weights see every tp rank's rows). Which tensors are split is the planner's (:mod:`shardwise.plan.tensors`,
    Shoeybi et al. 2019 §3)."""
    if lay.tp == 1:
        return 0.0

    def summed(p) -> bool:
        if ".experts." in p.name and lay.etp > 1:
            return lay.sequence_parallel and p.name.endswith("experts.fc_out.bias")
        return (p.split == "whole" and lay.sequence_parallel) or (p.split == "column_kv" and lay.tp > m.n_kv_heads)

    total = sum(p.numel * 4 // (lay.ep if ".experts." in p.name else 1) for p in model_params(m) if summed(p))
    return float(total * lay.grad_accum)


def measured_for_run(run_dir: Path) -> dict[str, float]:
    """Medians over the run's steps; step 1 (warm-up, and the collectives of the step-0 evaluation
    that the trainer logs as a ``step: 0`` record) is left out when there are later steps."""
    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("step", 0) >= 2] or records
    out: dict[str, float] = {}
    keys = {k for r in records for k in r if k != "step"}
    for key in sorted(keys):
        values = [r[key] for r in (steps if key != "mem_peak_rss_bytes" else records)
                  if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if values:
            out[key] = max(values) if key.startswith("mem_") else statistics.median(values)
    return out


def compare_run(run_dir: Path, as_json: bool = False, gpu: str = "H100", hardware: str | None = None,
                efficiency: float = 0.5) -> int:
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.toml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} does not exist; is {run_dir} a shardwise run directory?")
    cfg = Config.load(cfg_path)
    pred = predicted_for_run(cfg)
    meas = measured_for_run(run_dir)
    world = (cfg.parallel.nproc or 1) * cfg.parallel.nnodes
    derived = {}
    if "tokens_per_s" in meas:
        derived["achieved_flops_per_rank"] = meas["tokens_per_s"] * pred["flops_per_token"] / world
        if meas.get("mfu"):
            derived["implied_peak_flops"] = derived["achieved_flops_per_rank"] / meas["mfu"]
    rows = [("comm_bytes", pred["comm_bytes"], meas.get("comm_bytes")),
            ("comm_sent_bytes", pred["comm_sent_bytes"], meas.get("comm_sent_bytes")),
            ("mem_device_bytes vs mem_peak_rss_bytes", pred["mem_device_bytes"], meas.get("mem_peak_rss_bytes"))]
    if cfg.parallel.pp > 1:
        rows.insert(2, ("pp_sent_bytes", pred["pp_sent_bytes"], meas.get("pp_sent_bytes")))
    if cfg.parallel.tp > 1:
        rows.insert(2, ("tp_sent_bytes", pred["tp_sent_bytes"], meas.get("tp_sent_bytes")))
    if cfg.parallel.cp > 1:
        rows.insert(2, ("cp_sent_bytes", pred["cp_sent_bytes"], meas.get("cp_sent_bytes")))
        rows.insert(3, ("cp_attn_act_bytes", pred.get("cp_attn_act_bytes"), meas.get("cp_attn_act_bytes")))
    if cfg.parallel.ep > 1:
        rows.insert(2, ("ep_sent_bytes", pred["ep_sent_bytes"], meas.get("ep_sent_bytes")))
    rows += [(k, pred[k], meas.get(k)) for k in (*MEMORY_METRICS, "mem_total_bytes")]
    rows += [(k, pred.get(k), meas.get(k)) for k in FLUSH_METRICS if k in pred or k in meas]
    times = step_times(cfg, gpu, hardware, efficiency)
    for k in ("step_time_s", "tokens_per_s", "mfu"):
        rows += [(f"{k} (formula, {gpu})", times["formula"][k], meas.get(k)),
                 (f"{k} (simulated, {gpu})", times["simulated"][k], meas.get(k))]
    rows += [("parameters", pred["parameters"], None), ("flops_per_token", pred["flops_per_token"], None)]
    rows += [(k, v, None) for k, v in derived.items()]
    if as_json:
        print(json.dumps({"run_dir": str(run_dir), "predicted": pred, "measured": meas, "derived": derived,
                          "step_time": times,
                          "note": "activations and buffers are not measured by the trainer yet"},
                         indent=2))
        return 0
    print(f"run {run_dir}: {cfg.model.preset}, world {world}, global batch {cfg.train.global_batch}, "
          f"seq_len {cfg.data.seq_len}")
    print(f"{'quantity':<40} {'predicted':>16} {'measured':>16} {'measured/pred':>14}")
    for name, p, m in rows:
        ratio = f"{m / p:.3f}" if p and m is not None else ""
        print(f"{name:<40} {_fmt(p):>16} {_fmt(m):>16} {ratio:>14}")
    print("note: the trainer measures model states (mem_params/grads/master/optimizer/total_bytes), not yet "
          "activations or buffers; peak RSS also holds the interpreter, torch and the data.")
    if meas.get("comm_backend_bytes") and "comm_sent_bytes" not in meas:
        print(f"note: comm_sent_bytes is not measured: {_fmt(meas['comm_backend_bytes'])} bytes a step went to the "
              "backend's own collectives, whose wire traffic is not visible; with --comm.algorithm ring every "
              "byte on the wire is counted where it is sent.")
    return 0


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"
