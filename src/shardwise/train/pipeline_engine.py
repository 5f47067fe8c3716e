"""The training engine for pipeline parallelism composed with data parallelism (pp x dp ranks).

Each rank builds only its stages (:func:`~shardwise.parallel.pipeline.build_stage`; ``v`` chunks per rank
for the interleaved schedule, chunk ``c`` being global stage ``c * p + r``), runs a step's micro-batches
through the schedule (:class:`~shardwise.parallel.pipeline.Pipeline`), averages gradients over the
data-parallel group once after the last micro-batch (:class:`~shardwise.parallel.pipeline.grad_sync.GradientSync`),
clips by the global norm over the pipeline (:func:`~shardwise.parallel.pipeline.clip_grad_norm`) and steps an
AdamW over its own parameters. The last stage's loss is broadcast along the pipeline.

Checkpoints are layout-free: every stage writes its own weights and optimizer moments (nothing is gathered)
under the single-process model's names and optimizer indices (:func:`~shardwise.train.optim.optimizer_param_names`),
so a pipeline run resumes on any other layout and vice versa. Every step the pipeline's timelines are
gathered to report the measured bubble beside the theoretical one (Narayanan et al. 2021 §2.2) and each
stage rank's peak of live micro-batch activations; ``timeline.json`` in the run directory keeps one step's
events for ``shardwise plot timeline``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import Config
from shardwise.config_resolve import pipeline_partition
from shardwise.dist.comm.compress import gradient_all_reduce
from shardwise.dist.comm.counting import CommLedger
from shardwise.dist.mesh import Mesh
from shardwise.model import Transformer
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.pipeline import (
    Pipeline,
    Timeline,
    bubble_fraction,
    build_stage,
    clip_grad_norm,
    gather_timelines,
    global_grad_norm,
    partition,
    theoretical_bubble,
    zb_h1_bubble,
)
from shardwise.parallel.pipeline.grad_sync import GradientSync
from shardwise.parallel.pipeline.timeline import Event
from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer
from shardwise.parallel.zero.checkpoint import zero_checkpoint_pieces
from shardwise.train import memory as train_memory
from shardwise.train import tp_state
from shardwise.train.engines import load_model_state
from shardwise.train.optim import build_optimizer, decay_groups, optimizer_param_names
from shardwise.train.precision import DynamicLossScaler, autocast_context
from shardwise.train.sharded import Piece


class PipelineEngine:
    """This rank's stages of one pipeline replica, and the step that trains them."""

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device, run_dir: Path):
        p = cfg.parallel
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.group = mesh.group("dp_cp")  # replicas of the same weights: dp x cp
        self.pp_group, self.stage_ranks = mesh.group("pp"), mesh.ranks("pp")
        self.tp_size, self.tp_rank = mesh.size("tp"), mesh.rank("tp")
        self.tp_group = mesh.group("tp") if self.tp_size > 1 else None
        self.ledger = CommLedger()
        self.p, self.v, self.m = p.pp, p.pp_virtual, p.microbatches
        rank = mesh.rank("pp")
        method, boundaries = pipeline_partition(p.pp_partition)
        self.split = partition(cfg.model, self.p * self.v, method, boundaries, seq_len=cfg.data.seq_len)
        chunks = []
        for c in range(self.v):
            stage = c * self.p + rank
            chunk = build_stage(cfg.model, stage, self.p * self.v, self.split[stage], cfg.train.seed, device)
            parallelize(chunk, mesh, cfg, self.ledger)  # TP/SP -> recompute, on this stage's modules
            chunks.append(chunk)
        self.module = nn.ModuleList(chunks)  # for accounting and train/eval mode; names via chunks
        precision = cfg.train.precision
        self.pipe = Pipeline(chunks, self.stage_ranks, p.pp_schedule, self.m, cfg.model.d_model,
                             device=device, forward_context=lambda: autocast_context(precision, device.type),
                             comm_stats=self.ledger["pp"])
        self.zero = None
        if p.zero:  # ZeRO-1 over the stage's data-parallel replicas (Megatron's distributed optimizer)
            (chunk,) = chunks
            self.zero = ZeroDataParallel(chunk, group=self.group, stage=1, bucket_mb=p.bucket_mb,
                                         comm_stats=self.ledger["dp"])
            self.optimizer = ZeroOptimizer(self.zero, build_optimizer(self.module, cfg.train, self._named_parameters()))
        else:
            self.sync = GradientSync(self.pipe.parameters(), self.group, p.bucket_mb,
                                     gradient_all_reduce(cfg.comm, self.ledger["dp"]))
            self.optimizer = build_optimizer(self.module, cfg.train, self._named_parameters())
        with torch.device("meta"):  # the single-process optimizer's (decayed, undecayed) names: its index order
            self.reference_groups = decay_groups(Transformer(cfg.model).named_parameters())[:2]
        self.timelines: list[Timeline] = []
        self.wrapper = self  # the memory accountant reads ``.module``

    def _named_parameters(self):
        for chunk in self.pipe.chunks:
            yield from chunk.named_parameters()

    def describe(self) -> str:
        stages = ", ".join(f"{s.start}-{s.stop - 1}" for s in self.split)
        chunks = f", {self.v} chunks per rank" if self.v > 1 else ""
        return (f"pp={self.p} x dp={self.mesh.dp_size}, {self.cfg.parallel.pp_schedule} schedule, "
                f"{self.m} micro-batches{chunks}; blocks per stage {stages}")

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str,
                         scaler: DynamicLossScaler | None) -> torch.Tensor:
        """One step of the schedule over the concatenated micro-batches, then the data-parallel average."""
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        self.pipe.loss_scale = scaler.scale if scaler else 1.0
        if self.zero is not None:  # gradients accumulate over the schedule, then one reduce-scatter each
            with self.zero.no_sync():
                loss = self.pipe.step(x, y)
            self.zero.reduce_gradients()
        else:
            loss = self.pipe.step(x, y)
            self.sync()
        self.timelines = gather_timelines(self.pipe.timeline, self.pp_group)
        return self._from_last_stage(loss)

    def _from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        out = torch.zeros((), dtype=torch.float64, device=self.device) if loss is None else loss.double()
        dist.broadcast(out, src=self.stage_ranks[-1], group=self.pp_group)
        return out

    def unscale_and_clip(self, scaler: DynamicLossScaler | None, max_norm: float) -> tuple[bool, float]:
        if self.zero is not None:  # the reduced gradients live in this rank's master slices
            found_inf = scaler.unscale_(self.optimizer.master_params(), group=dist.group.WORLD) if scaler else False
            tied = self.pipe.chunks[0].tied_weight  # counted by the first stage only
            skip = frozenset({id(tied)}) if tied is not None and self.pipe.stage(0) != 0 else frozenset()
            return found_inf, self.zero.clip_grad_norm_(max_norm, self.tp_group, self.pp_group, skip)
        found_inf = scaler.unscale_(self.pipe.parameters(), group=dist.group.WORLD) if scaler else False
        if max_norm > 0:
            return found_inf, float(clip_grad_norm(self.pipe, max_norm, self.pp_group, self.tp_group))
        return found_inf, float(global_grad_norm(self.pipe, self.pp_group, self.tp_group))

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, precision: str) -> torch.Tensor:
        return self._from_last_stage(self.pipe.forward_only(x, y))

    def train_mode(self, on: bool) -> None:
        self.module.train(on)

    def comm_metrics(self) -> dict[str, float]:
        """The data-parallel gradient all-reduce (``dp_sent_bytes``) and this rank's point-to-point sends
        (``pp_sent_bytes``: activations forward, their gradients backward, the tied table's gradient), as
        counted where they were called (:mod:`shardwise.dist.comm.counting`)."""
        return self.ledger.pop_metrics()

    def step_metrics(self) -> dict[str, float]:
        """Measured and theoretical bubble of the last step, and every stage rank's peak live activations."""
        if not self.timelines:
            return {}
        out = {"bubble": bubble_fraction(self.timelines), "bubble_theory": self.bubble_theory()}
        out.update({f"pp_peak_live_{t.rank}": float(t.peak_live) for t in self.timelines})
        return out

    def bubble_theory(self) -> float:
        """The schedule's idle fraction with equal stages: (p - 1) / (v m + p - 1) for GPipe / 1F1B /
        interleaved; ZB-H1's with T_F = T_B = T_W (Qi et al. 2024 §3.1)."""
        if self.cfg.parallel.pp_schedule == "zb-h1":
            return zb_h1_bubble(self.p, self.m)
        return theoretical_bubble(self.p, self.m, self.v)

    def write_timeline(self, run_dir: Path, step: int) -> None:
        """Keep the last step's timelines as ``timeline.json`` (rank 0 of the world writes)."""
        if dist.get_rank() != 0 or not self.timelines:
            return
        doc = {"step": step, "schedule": self.cfg.parallel.pp_schedule, "pp": self.p, "microbatches": self.m,
               "virtual": self.v, "bubble": bubble_fraction(self.timelines),
               "bubble_theory": self.bubble_theory(),
               "timelines": [dataclasses.asdict(t) for t in self.timelines]}
        tmp = Path(run_dir) / "timeline.json.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(Path(run_dir) / "timeline.json")

    def memory_bytes(self) -> dict[str, int]:
        return train_memory.model_state_bytes(self.zero if self.zero is not None else self, self.optimizer)

    # ---- layout-free checkpoints -----------------------------------------------------------------

    def checkpoint_pieces(self) -> tuple[list[Piece], list[dict] | None]:
        """Each stage (its data-parallel rank 0; replicas are equal) writes its own layers and their
        optimizer state whole, under the single-process names and optimizer indices: nothing is gathered."""
        groups = None
        if dist.get_rank() == 0:
            decay, no_decay = self.reference_groups
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            groups = [dict(hyper[0], params=list(range(len(decay)))),
                      dict(hyper[1], params=list(range(len(decay), len(decay) + len(no_decay))))]
        decay, no_decay = self.reference_groups
        ref_index = {n: i for i, n in enumerate(decay + no_decay)}
        local_names = optimizer_param_names(self._named_parameters())
        if self.zero is not None:  # every replica writes the slices of its shard, under single-process indices
            return zero_checkpoint_pieces(self.zero, self.optimizer, with_buffers=self.mesh.rank("dp_cp") == 0,
                                          ref_map=lambda i: ref_index[local_names[i]]), groups
        if self.mesh.rank("dp_cp") != 0:
            return [], groups
        opt = self.optimizer.state_dict()["state"]  # its stages' tensors (this tensor-parallel rank's rows)
        local = [p for g in self.optimizer.param_groups for p in g["params"]]
        params = {ref_index[local_names[i]]: local[i] for i in range(len(local))}
        state = {ref_index[local_names[i]]: st for i, st in opt.items()}
        return ([p for c in self.pipe.chunks for p in tp_state.model_pieces(c, self.tp_rank)]
                + tp_state.optimizer_pieces(params, state, self.tp_rank)), groups

    def load_state(self, model_state: Mapping, optimizer_state: dict) -> None:
        """Take this rank's layers (and their optimizer state) from the single-process state."""
        if self.zero is not None:
            self._load_zero(model_state, optimizer_state)
            return
        for chunk in self.pipe.chunks:
            tp_state.load_model(chunk, model_state)
        decay, no_decay = self.reference_groups
        ref_index = {n: i for i, n in enumerate(decay + no_decay)}
        saved = {int(k): v for k, v in optimizer_state["state"].items()}
        local_names = optimizer_param_names(self._named_parameters())
        state = {i: dict(saved[ref_index[n]]) for i, n in enumerate(local_names) if ref_index[n] in saved}
        local = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = tp_state.local_optimizer_state(local, state)
        live_groups = self.optimizer.state_dict()["param_groups"]
        groups = [dict({k: v for k, v in saved_g.items() if k != "params"}, params=live_g["params"])
                  for saved_g, live_g in zip(optimizer_state["param_groups"], live_groups, strict=True)]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _load_zero(self, model_state: Mapping, optimizer_state: dict) -> None:
        """ZeRO-1 stage: the stage's tensors (cut to this tensor-parallel rank's rows) into the shards, and
        the optimizer state of its parameters, re-indexed from the single-process optimizer's order."""
        (chunk,) = self.pipe.chunks
        own = {k: model_state[k] for k in chunk.state_dict()}
        if self.tp_size > 1:
            own = tp_state.LocalView(own, dict(chunk.named_parameters(remove_duplicate=False)).get)
        load_model_state(self.zero, own)
        decay, no_decay = self.reference_groups
        ref_index = {n: i for i, n in enumerate(decay + no_decay)}
        saved = {int(k): v for k, v in optimizer_state["state"].items()}
        local_names = optimizer_param_names(self._named_parameters())
        local = [p for g in self.optimizer.reference_groups for p in g]
        state = {i: saved[ref_index[n]] for i, n in enumerate(local_names) if ref_index[n] in saved}
        if self.tp_size > 1:
            state = {i: tp_state.LocalView.of_tensor(st, local[i]) for i, st in state.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": optimizer_state["param_groups"]})

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on global rank 0 (every stage sends its layers; for tests and tools)."""
        if self.tp_size > 1:
            return tp_state.gather_full_state(list(self.pipe.chunks), self.tp_rank, active=self.mesh.rank("dp_cp") == 0)
        mine: dict[str, torch.Tensor] = {}
        for chunk in self.pipe.chunks:
            mine.update({k: v.detach().cpu() for k, v in chunk.state_dict().items()})
        out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine if self.mesh.rank("dp_cp") == 0 else None, out, dst=0)
        full: dict[str, torch.Tensor] = {}
        for stage_state in out or []:
            for k, v in (stage_state or {}).items():
                full.setdefault(k, v)
        return full


def timelines_from_json(doc: dict) -> list[Timeline]:
    """The timelines :meth:`PipelineEngine.write_timeline` stored."""
    out = []
    for t in doc["timelines"]:
        events = [Event(**e) for e in t["events"]]
        out.append(Timeline(rank=t["rank"], events=events, peak_live=t["peak_live"], start=t["start"], end=t["end"]))
    return out
