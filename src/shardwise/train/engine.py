"""The one training engine: every layout is the same plain model with techniques applied from outside.

The loop (:mod:`shardwise.train.loop`) drives one :class:`Engine` whatever the layout. The engine composes
the layout in one fixed order (DESIGN.md, "How layouts compose"; torchtitan's ``parallelize`` does the same):

1. **model parts**: the pipeline cuts first -- with ``parallel.pp > 1`` this rank builds only its stages
   (``v`` chunks for the interleaved schedule, chunk ``c`` being global stage ``c * p + r``); with pp = 1
   its one part is the whole model (on the meta device for ZeRO-3, which materialises only its slices; with
   tensor or expert parallelism every part is built on the meta device and its pieces allocated once cut,
   :mod:`~shardwise.parallel.materialize`).
   Every part is initialised from ``(seed, name, shape)`` alone, so it equals that part of the
   single-process model;
2. **parallelize** each part (:func:`~shardwise.parallel.parallelize.parallelize`): tensor / sequence
   parallel -> (context parallel, experts) -> activation recomputation;
3. **data parallel** over the gradient-reduction group: plain replicas with bucketed all-reduce
   (:class:`~shardwise.parallel.data.DataParallel`) or ZeRO-1/2/3
   (:class:`~shardwise.parallel.zero.ZeroDataParallel`, with its :class:`~shardwise.parallel.zero.ZeroOptimizer`);
4. **schedule** (:mod:`shardwise.train.schedules`): one stage (plain forward/backward per micro-batch,
   gradients reduced during the last backward) or a pipeline schedule (reduced after the flush).

What every layout shares is then written once: one global gradient norm and clip over per-parameter
metadata (:mod:`shardwise.parallel.grad_norm`), one verdict on whether a step is applied (non-finite loss or
gradient, fp16 overflow, norm spike; :mod:`shardwise.train.step_guard`), one memory account, and layout-free
checkpoints -- this rank's pieces of the single-process model and optimizer state under the single-process
names and optimizer indices (:class:`ReferenceOrder`), loaded back resharded to any layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import Config
from shardwise.dist.comm.compress import gradient_all_reduce
from shardwise.dist.comm.counting import CommLedger
from shardwise.dist.mesh import Mesh
from shardwise.model import Transformer
from shardwise.model.transformer import init_kwargs, initial_value
from shardwise.parallel.context import pop_attention_work
from shardwise.parallel.data import DataParallel
from shardwise.parallel.dropout import replica_key
from shardwise.parallel.expert import state as expert_state
from shardwise.parallel.expert.router_step import StageBlocks, router_step
from shardwise.parallel.grad_norm import clip_grad_norm_on_device
from shardwise.parallel.materialize import materialize_parameters, reset_buffers
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.pipeline import Pipeline, build_stage
from shardwise.parallel.pipeline.clip import tied_copies_elsewhere
from shardwise.parallel.pipeline.partition import StageChunks, config_split
from shardwise.parallel.tensor import state as tp_state
from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer
from shardwise.parallel.zero.checkpoint import zero_checkpoint_pieces
from shardwise.parallel.zero.meta import materialize_buffers
from shardwise.parallel.zero.reduce import overlaps_reduce
from shardwise.train import memory as train_memory
from shardwise.train.checkpoint import CheckpointError
from shardwise.train.optim import build_optimizer, decay_groups, optimizer_param_names
from shardwise.train.precision import DynamicLossScaler, autocast_context
from shardwise.train.readout import Late
from shardwise.train.schedules import OneStage, PipelineSchedule
from shardwise.train.sharded import Piece
from shardwise.train.step_guard import StepVerdict, agree


def load_model_state(module: nn.Module, state: Mapping) -> None:
    """Load ``state`` into ``module``; a missing or unexpected key is a :class:`CheckpointError`."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint model does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")


class ReferenceOrder:
    """The single-process optimizer's parameter indices, seen from this rank's model parts.

    A checkpoint stores optimizer state under the index the single-process AdamW gives each parameter
    (decayed parameters first, :func:`~shardwise.train.optim.decay_groups`). This rank's optimizer indexes
    only the parameters it holds, in the same rule's order; ``ref[i]`` is the single-process index of local
    index ``i`` (the identity for a whole model)."""

    def __init__(self, model_cfg, local_named: Iterator[tuple[str, nn.Parameter]]):
        with torch.device("meta"):
            decay, no_decay, _ = decay_groups(Transformer(model_cfg).named_parameters())
        index = {n: i for i, n in enumerate(decay + no_decay)}
        self.n_decay, self.n_total = len(decay), len(decay) + len(no_decay)
        self.ref = [index[n] for n in optimizer_param_names(local_named)]

    def param_groups(self, live_groups: list[dict]) -> list[dict]:
        """The single-process optimizer's ``param_groups``: the live hyper-parameters (a learning rate held as a
        device tensor read as a number), every index."""
        hyper = [{k: float(v) if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
                 for g in live_groups]
        return [dict(hyper[0], params=list(range(self.n_decay))),
                dict(hyper[1], params=list(range(self.n_decay, self.n_total)))]

    def local_state(self, saved: Mapping) -> dict[int, Mapping]:
        """The saved single-process optimizer state re-keyed by this rank's indices."""
        saved = {int(k): v for k, v in saved.items()}
        return {i: saved[r] for i, r in enumerate(self.ref) if r in saved}


class Engine:
    """This rank's part of the model under every technique the config turns on, and the step that trains it."""

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device, run_dir: Path):
        p = cfg.parallel
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.group = mesh.group("dp_cp")
        """The gradient-reduction group: the ranks holding the same weights (dp x cp; context-parallel ranks
        hold the same part and see other pieces of the same sequences)."""
        self.ledger = CommLedger()
        """Every collective of this rank's techniques, counted where it is called, by mesh axis."""
        self.tp_rank = mesh.rank("tp")
        self.tp_group = mesh.group("tp") if mesh.size("tp") > 1 else None
        self.pp_group = mesh.group("pp") if p.pp > 1 else None
        self.ep_group = mesh.group("ep") if mesh.size("ep") > 1 else None  # experts split: norm and state
        torch.manual_seed(cfg.train.seed)
        # 1. model parts (the pipeline cuts first), 2. techniques applied to each part
        self.parts = self._build_parts()
        for part in self.parts:
            parallelize(part, mesh, cfg, self.ledger)
            if self._cut_on_meta:  # tp / ep cut a meta part: now allocate only this rank's pieces
                materialize_parameters(part, cfg.model, cfg.train.seed, device, values=not cfg.model.init_from)
        self.module = self.parts[0] if len(self.parts) == 1 else StageChunks(self.parts)
        """What the data-parallel wrapper holds: the one part, or this rank's interleaved chunks (under their
        single-process names)."""
        # 3. data parallel (plain or ZeRO) over the gradient-reduction group, and the optimizer
        self.zero = p.zero > 0
        self.wrapper = self._wrap(run_dir)
        reference = build_optimizer(self.module, cfg.train, self._named_parameters())
        self.optimizer = ZeroOptimizer(self.wrapper, reference) if self.zero else reference
        self.order = ReferenceOrder(cfg.model, self._named_parameters())
        # 4. the schedule of a step
        self.schedule = self._schedule()
        self._moe_stages = (StageBlocks.gather(self.module, self.pp_group, cfg.model.n_experts)
                            if self.pp_group is not None and cfg.model.n_experts else None)
        """Which MoE blocks each pipeline stage holds: how the router step joins their sums on the device."""
        self._tied_elsewhere = tied_copies_elsewhere(self.parts, [getattr(p, "stage", 0) for p in self.parts])
        """The tied table's copy on the last stage: counted in the gradient norm by the first stage only."""

    # ---- composing the layout ---------------------------------------------------------------------

    def _build_parts(self) -> list[nn.Module]:
        cfg, p = self.cfg, self.cfg.parallel
        self._cut_on_meta = self.tp_group is not None or self.ep_group is not None
        """Tensor / expert parallelism cut the part on the meta device; its pieces are allocated afterwards
        (:mod:`shardwise.parallel.materialize`), so no rank ever holds its whole stage."""
        if p.pp > 1:
            self.split = config_split(cfg)
            rank = self.mesh.rank("pp")
            stages = [c * p.pp + rank for c in range(p.pp_virtual)]
            device = torch.device("meta") if self._cut_on_meta else self.device
            parts = [build_stage(cfg.model, s, p.pp * p.pp_virtual, self.split[s], cfg.train.seed, device)
                     for s in stages]
            for part in parts if self._cut_on_meta else []:
                materialize_buffers(part, self.device)
                reset_buffers(part)
            return parts
        if self._cut_on_meta or p.zero == 3:
            # ZeRO-3 materialises only its slices, tp and ep only their pieces (after parallelize)
            with torch.device("meta"):
                module = Transformer(cfg.model)
            materialize_buffers(module, self.device)
            module.reset_parameters(cfg.train.seed)  # fills the buffers; meta parameters are skipped
            return [module]
        module = Transformer(cfg.model)
        module.reset_parameters(cfg.train.seed)
        return [module.to(self.device)]

    def _named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their single-process names."""
        for part in self.parts:
            yield from part.named_parameters()

    def _param_init(self):
        """The full initial value of one parameter of a meta-built model (``None``: the model is real)."""
        if not any(p.is_meta for p in self.module.parameters()):
            return None
        names = {id(p): n for n, p in self.module.named_parameters_for_init()}
        m, seed = self.cfg.model, self.cfg.train.seed
        return lambda _name, p: initial_value(names[id(p)], p.shape, seed, **init_kwargs(m))

    def _wrap(self, run_dir: Path):
        p = self.cfg.parallel
        expert_group = self.mesh.group("edp") if self.ep_group is not None else None  # replicas of my experts
        if not self.zero:  # a gradient dtype of its own is the all-reduce's cast (comm.compression, unset then)
            comm = self.cfg.comm if p.grad_reduce_dtype == "auto" else dataclasses.replace(
                self.cfg.comm, compression="none" if p.grad_reduce_dtype == "fp32" else p.grad_reduce_dtype)
            return DataParallel(self.module, group=self.group, bucket_mb=p.bucket_mb,
                                all_reduce_fn=gradient_all_reduce(comm, self.ledger["dp"], p.nproc),
                                expert_group=expert_group, comm_stats=self.ledger["dp"])
        reduce_dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[p.grad_reduce_dtype]
        return ZeroDataParallel(self.module, group=self.group, stage=p.zero, bucket_mb=p.bucket_mb,
                                overlap_reduce=overlaps_reduce(p.zero, self.device.type == "cuda",
                                                               p.zero_overlap_grad_reduce),
                                overlap_param_gather=p.zero_overlap_param_gather, reduce_dtype=reduce_dtype,
                                unit_blocks=p.zero_unit, offload=p.offload,
                                param_dtype=torch.bfloat16 if p.zero_param_dtype == "bf16" else None,
                                offload_dir=p.offload_dir or str(run_dir / "offload"),
                                quant_weights=p.zero_quant_weights, quant_grads=p.zero_quant_grads,
                                hpz_size=p.zero_hpz, comm_stats=self.ledger["dp"],
                                hpz_group=self.mesh.subgroup("dp_cp", p.zero_hpz) if p.zero_hpz > 1 else None,
                                param_init=self._param_init(), device=self.device, expert_group=expert_group)

    def _schedule(self):
        p, precision, device = self.cfg.parallel, self.cfg.train.precision, self.device
        if p.pp == 1:
            return OneStage(self.wrapper, precision, device)
        # activations travel in the dtype the stages compute them in: bf16 when ZeRO keeps bf16 parameters
        act_dtype = torch.bfloat16 if self.zero and p.zero_param_dtype == "bf16" else torch.float32
        pipe = Pipeline(self.parts, self.mesh.ranks("pp"), p.pp_schedule, p.microbatches, self.cfg.model.d_model,
                        act_dtype=act_dtype, device=device,
                        forward_context=lambda: autocast_context(precision, device.type),
                        comm_stats=self.ledger["pp"], seq_shards=p.tp if p.sequence_parallel else 1,
                        tokens_to_every_stage=self.cfg.train.objective == "classify")
        return PipelineSchedule(pipe, self.wrapper, self.mesh.group("pp"), self.mesh.ranks("pp"), p.pp_schedule,
                                device)

    def describe(self) -> str:
        p = self.cfg.parallel
        out = f"dp={self.mesh.dp_size}" + (f" (ep={p.ep})" if self.ep_group is not None else "")
        if self.tp_group is not None:
            out += f" x tp={p.tp}" + (" (sequence parallel)" if p.sequence_parallel else "")
        if self.mesh.size("cp") > 1:
            out += f" x cp={p.cp} ({p.cp_algorithm}, {p.cp_balance})"
        if self.pp_group is not None:
            stages = ", ".join(f"{s.start}-{s.stop - 1}" for s in self.split)
            chunks = f", {p.pp_virtual} chunks per rank" if p.pp_virtual > 1 else ""
            out += (f" x pp={p.pp}, {p.pp_schedule} schedule, {p.microbatches} micro-batches{chunks}; "
                    f"blocks per stage {stages}")
        return out + (f", zero={p.zero}" if self.zero else "")

    # ---- the step ---------------------------------------------------------------------------------

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str,
                         scaler: DynamicLossScaler | None, step: int = 0) -> torch.Tensor:
        """The mean loss of this replica's micro-batches of optimizer step ``step``; gradients averaged over the
        group when it returns. With dropout the schedule hands every forward the key of its micro-batch's place
        in the step's global batch, so every layout draws the masks one process draws."""
        key = None
        if self.cfg.model.dropout:
            key = replica_key(self.cfg.train.seed, step, self.mesh.dp_rank, self.cfg.train.global_batch,
                              self.mesh.dp_size)
        return self.schedule.run(batches, scaler, key)

    def check_step(self, replica_loss: torch.Tensor, scaler: DynamicLossScaler | None, max_norm: float,
                   skip_above: float = 0.0) -> StepVerdict:
        """Before the optimizer step: fp16 unscales the gradients this rank holds; the global gradient norm of the
        single-process model is measured and the gradients clipped to ``max_norm`` (0: only measured); then every
        rank agrees on the step's loss and on whether it is applied (:func:`~shardwise.train.step_guard.agree`:
        one all-reduce over the world, which is also the loss's). Nothing is read on the host."""
        pieces = self.wrapper.grad_pieces()
        found_inf = scaler.unscale_grads_([g for g, _ in pieces]) if scaler else None
        # under ZeRO each expert element is in one slice of one rank of the data-parallel group (its ep rank's
        # experts, its edp rank's slice), so the sum over the shard group counts it once: no sum over ep
        ep_group = None if self.zero else self.ep_group
        norm = clip_grad_norm_on_device(pieces, max_norm, tp_group=self.tp_group,
                                        shard_group=self.wrapper.shard_group, pp_group=self.pp_group,
                                        ep_group=ep_group, skip=self._tied_elsewhere, device=self.device)
        # one rank per dp x cp replica counts the loss: tensor-parallel ranks and pipeline stages hold it too
        counts = self.tp_rank == 0 and self.mesh.rank("pp") == 0
        return agree(replica_loss, norm, found_inf, loss_counts=counts, loss_ranks=self.mesh.size("dp_cp"),
                     skip_above=skip_above)

    def grad_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """``(gradient piece, parameter)`` of what this rank holds of the gradient and counts in its norm (a weight
        tied between pipeline stages is counted by the first one)."""
        return [(g, p) for g, p in self.wrapper.grad_pieces() if id(p) not in self._tied_elsewhere]

    def micro_losses(self) -> torch.Tensor | None:
        """This rank's loss of each micro-batch of the last step (None where the schedule does not keep them: a
        pipeline's are on its last stage): to name the micro-batch a non-finite loss came from."""
        return getattr(self.schedule, "micro_losses", None)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, precision: str) -> torch.Tensor:
        return self.schedule.eval_loss(x, y)

    def train_mode(self, on: bool) -> None:
        self.module.train(on)

    def comm_choices(self) -> dict[int, str]:
        """With comm.algorithm "auto": the all-reduce algorithm the cost model chose per bucket size (bytes)."""
        return dict(getattr(getattr(self.wrapper, "all_reduce_fn", None), "choices", {}))

    def comm_metrics(self) -> dict[str, float]:
        """This step's communication as the counting layer recorded it (:meth:`CommLedger.pop_metrics`)."""
        return self.ledger.pop_metrics()

    def step_metrics(self, skipped: torch.Tensor | None = None, timeline: bool = False) -> dict[str, float]:
        """The schedule's (a pipeline's bubble), and where those techniques are on, the context-parallel
        attention work and the experts' load (each a small collective; not looked for when off). With MoE
        blocks it also ends the routers' step: their load summed over the global batch moves the
        ``sigmoid_bias`` routers' balancing biases (:func:`~shardwise.parallel.expert.router_step.router_step`),
        not where ``skipped`` (a 0-dim device flag) is 1; the loop calls it once after every optimizer step.
        ``dp_reduced_in_backward``: the gradient buckets (ZeRO: units) whose reduction the last step launched
        during backward -- before it ended, or in a pipeline before the flush -- and left running beside it.
        ``timeline``: this step reports a pipeline's measured timeline (bubble, peak live activations).
        The experts' metrics come as a :class:`~shardwise.train.readout.Late` entry, read with the step."""
        out = self.schedule.step_metrics(timeline)
        early = getattr(self.wrapper, "overlapped_units_last_step", None)
        early = getattr(self.wrapper, "overlapped_buckets_last_step", None) if early is None else early
        if early is not None and self.mesh.size("dp_cp") > 1:
            out["dp_reduced_in_backward"] = float(early)
        if self.mesh.size("cp") > 1:  # the attention seconds: the device's clock, read with the step
            out["cp"] = Late(pop_attention_work(self.module))
        if self.cfg.model.n_experts:
            sp = self.tp_group if self.cfg.parallel.sequence_parallel else None
            out["moe"] = Late(router_step(self.module, self.group, self.pp_group, seq_group=sp, skipped=skipped,
                                          stages=self._moe_stages, device=self.device))
        return out

    def write_timeline(self, run_dir: Path, step: int) -> None:
        self.schedule.write_timeline(run_dir, step)

    def settle(self) -> None:
        """Wait for what the last step left in flight (ZeRO-1/2's parameter gathers, launched after the step for
        the next forward): a run ends with no message of it still travelling."""
        wait = getattr(self.wrapper, "wait_for_params", None)
        if wait is not None:
            wait()

    def memory_bytes(self) -> dict[str, int]:
        return train_memory.model_state_bytes(self.wrapper, self.optimizer)

    # ---- layout-free checkpoints -----------------------------------------------------------------

    def checkpoint_pieces(self) -> tuple[list[Piece], list[dict] | None]:
        """What this rank writes into a checkpoint, and (on global rank 0) the single-process optimizer's
        param groups. A ZeRO rank writes the slices of its shard; otherwise replicas are equal and
        data-parallel rank 0 writes the tensors (the rows each tensor-parallel rank owns) of its parts."""
        groups = self.order.param_groups(self.optimizer.param_groups) if dist.get_rank() == 0 else None
        first = self.mesh.rank("dp_cp") == 0
        if self.zero:
            pieces = zero_checkpoint_pieces(self.wrapper, self.optimizer, with_buffers=first and self.tp_rank == 0,
                                            ref_map=lambda i: self.order.ref[i])
            return pieces, groups
        ep_writer = self.ep_group is not None and self.mesh.rank("edp") == 0  # the first ep group's experts
        if not first and not ep_writer:
            return [], groups
        local = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = self.optimizer.state_dict()["state"]
        params = {self.order.ref[i]: p for i, p in enumerate(local)}
        moments = {self.order.ref[i]: st for i, st in state.items()}
        if not first:
            return expert_state.expert_pieces(self.module, params, moments), groups
        return ([piece for part in self.parts for piece in tp_state.model_pieces(part, self.tp_rank)]
                + tp_state.optimizer_pieces(params, moments, self.tp_rank)), groups

    def load_state(self, model_state: Mapping, optimizer_state: dict) -> None:
        """Load the single-process model and optimizer state (lazy mappings from a checkpoint reader),
        resharded to this layout: this rank's parts, each tensor cut to its tensor-parallel rows, and (ZeRO)
        only the slices of its shard, read one tensor at a time."""
        saved = self.order.local_state(optimizer_state["state"])
        if self.zero:
            infos = dict(self._named_parameters_all())
            own = self.wrapper.module.state_dict(keep_vars=True).keys()
            load_model_state(self.wrapper, tp_state.LocalView(model_state, infos.get, keys=own))
            local = [p for g in self.optimizer.reference_groups for p in g]
            state = {i: tp_state.LocalView.of_tensor(st, local[i]) for i, st in saved.items()}
            self.optimizer.load_state_dict({"state": state, "param_groups": optimizer_state["param_groups"]})
            return
        for part in self.parts:
            tp_state.load_model(part, model_state)
        local = [p for g in self.optimizer.param_groups for p in g["params"]]
        live_groups = self.optimizer.state_dict()["param_groups"]
        groups = [dict({k: v for k, v in saved_g.items() if k != "params"}, params=live_g["params"])
                  for saved_g, live_g in zip(optimizer_state["param_groups"], live_groups, strict=True)]
        self.optimizer.load_state_dict({"state": tp_state.local_optimizer_state(local, saved), "param_groups": groups})

    def _named_parameters_all(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every name of every parameter of this rank's parts (a tied weight under both)."""
        for part in self.parts:
            yield from part.named_parameters(remove_duplicate=False)

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (a collective): on every rank when each holds the whole model (pp = tp
        = 1), else on global rank 0, assembled from every stage's and tensor-parallel rank's pieces."""
        state = self.wrapper.state_dict() if self.zero else None  # ZeRO: gathered over the group
        if self.ep_group is not None:
            return expert_state.gather_full_state(self.module, self.mesh.dp_rank, self.mesh.rank("edp"), self.tp_rank,
                                                  state=state)
        if self.tp_group is None and self.pp_group is None:
            return state if state is not None else self.module.state_dict()
        parts = self.parts if state is None else [self.wrapper.module]
        return tp_state.gather_full_state(parts, self.tp_rank, active=self.mesh.rank("dp_cp") == 0, state=state)
