"""How one training step runs on this rank, for each way of laying the model out.

The training loop (:mod:`shardwise.train.loop`) is the same for every layout; what differs is who
holds which weights and how gradients meet. An *engine* owns the model (or its part), the wrapper
that applies a technique from ``parallel/``, and the optimizer, and answers the loop's questions:

* ``forward_backward(batches, precision, scaler)``: the mean loss of this replica's micro-batches,
  gradients averaged over the data-parallel group when it returns;
* ``unscale_and_clip(scaler, max_norm)``: fp16 overflow check and global-norm clipping;
* ``eval_loss(x, y)``, ``train_mode(on)``; ``comm_metrics()``, ``step_metrics()``, ``memory_bytes()``;
* ``checkpoint_pieces()`` / ``load_state(model_state, optimizer_state)``: the pieces of the
  single-process model and optimizer state this rank writes (:mod:`shardwise.train.sharded`; the same
  keys and optimizer indices whatever the layout), and loading that state resharded to this layout,
  so a checkpoint resumes on any layout.

:class:`DataParallelEngine` (replicas, :mod:`shardwise.parallel.data`), :class:`ZeroEngine` (ZeRO-1/2/3,
:mod:`shardwise.parallel.zero`) and :class:`~shardwise.train.pipeline_engine.PipelineEngine`
(pp x dp, :mod:`shardwise.parallel.pipeline`); :func:`build_engine` picks one from the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import Config
from shardwise.dist.comm.compress import gradient_all_reduce
from shardwise.dist.comm.counting import CommLedger
from shardwise.dist.mesh import Mesh
from shardwise.model import Transformer
from shardwise.model.transformer import initial_value
from shardwise.parallel.data import DataParallel
from shardwise.parallel.expert import step_metrics as moe_step_metrics
from shardwise.parallel.grad_norm import clip_grad_norm, parameter_pieces
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.zero import ZeroDataParallel, ZeroOptimizer
from shardwise.parallel.zero.checkpoint import zero_checkpoint_pieces, zero_param_groups
from shardwise.parallel.zero.meta import materialize_buffers
from shardwise.train import expert_state, tp_state
from shardwise.train import memory as train_memory
from shardwise.train.checkpoint import CheckpointError
from shardwise.train.optim import build_optimizer
from shardwise.train.precision import DynamicLossScaler, autocast_context
from shardwise.train.sharded import Piece, materialized_optimizer_state


def load_model_state(module: torch.nn.Module, state: Mapping, strict_subset: bool = False) -> None:
    """Load ``state`` into ``module``; a missing or unexpected key is a :class:`CheckpointError`.
    With ``strict_subset`` the module takes only its own keys from a larger (whole-model) state."""
    if strict_subset:
        own = module.state_dict().keys()
        missing = [k for k in own if k not in state]
        if missing:
            raise CheckpointError(f"checkpoint model does not match: missing {missing[:3]}")
        state = {k: state[k] for k in own}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint model does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")


class DataParallelEngine:
    """Every rank of a data-parallel group holds the same model part (the whole model, or with
    ``parallel.tp`` its tensor-parallel piece); gradients are averaged by bucketed all-reduce during backward.

    The part is built from the single-device model and rewritten by
    :func:`~shardwise.parallel.parallelize.parallelize` (TP/SP, then recompute) before the data-parallel
    wrapper goes around it."""

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device, run_dir: Path):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.group = mesh.dp_group
        self.ledger = CommLedger()
        """Every collective of this rank's techniques, counted where it is called, by mesh axis."""
        torch.manual_seed(cfg.train.seed)
        self.tp_size, self.tp_rank = mesh.size("tp"), mesh.rank("tp")
        self.ep_group = mesh.group("ep") if mesh.size("ep") > 1 else None  # experts split: norm and state
        self.module = parallelize(self._build_module(), mesh, cfg, self.ledger)
        self.wrapper = self._wrap(run_dir)
        self.optimizer = self._optimizer()

    def _build_module(self) -> Transformer:
        """The whole model on this rank's device, initialised from ``train.seed``."""
        module = Transformer(self.cfg.model)
        module.reset_parameters(self.cfg.train.seed)
        return module.to(self.device)

    def _wrap(self, run_dir: Path):
        return DataParallel(self.module, group=self.group, bucket_mb=self.cfg.parallel.bucket_mb,
                            all_reduce_fn=gradient_all_reduce(self.cfg.comm, self.ledger["dp"]),
                            expert_group=self.mesh.group("edp") if self.ep_group is not None else None)

    def _optimizer(self):
        return build_optimizer(self.module, self.cfg.train)

    def describe(self) -> str:
        tp = f" x tp={self.tp_size}{' (sequence parallel)' if self.cfg.parallel.sequence_parallel else ''}"
        ep = f" (ep={self.mesh.size('ep')})" if self.ep_group is not None else ""
        return f"dp={self.mesh.dp_size}{ep}" + (tp if self.tp_size > 1 else "")

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str,
                         scaler: DynamicLossScaler | None) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with self.wrapper.no_sync() if not last else contextlib.nullcontext():
                with autocast_context(precision, self.device.type):
                    loss = self.wrapper(x, y)
                loss_sum += loss.detach()
                scaled = loss / len(batches)
                (scaler.scale_loss(scaled) if scaler else scaled).backward()
        return loss_sum / len(batches)

    def unscale_and_clip(self, scaler: DynamicLossScaler | None, max_norm: float) -> tuple[bool, float]:
        tp_group = self.mesh.group("tp") if self.tp_size > 1 else None  # other pieces: agree, norm over all
        agree = tp_group if self.ep_group is None else self.ep_group
        found_inf = scaler.unscale_(self.module.parameters(), group=agree) if scaler else False
        return found_inf, clip_grad_norm(parameter_pieces(self.module.parameters()), max_norm, tp_group=tp_group,
                                         device=self.device, ep_group=self.ep_group)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, precision: str) -> torch.Tensor:
        with autocast_context(precision, self.device.type):
            return self.module(x, y).double()

    def train_mode(self, on: bool) -> None:
        self.module.train(on)

    def comm_metrics(self) -> dict[str, float]:
        """This step's communication as the counting layer recorded it (:meth:`CommLedger.pop_metrics`)."""
        return self.ledger.pop_metrics()

    def step_metrics(self) -> dict[str, float]:
        return moe_step_metrics(self.module, self.group)

    def memory_bytes(self) -> dict[str, int]:
        return train_memory.model_state_bytes(self.wrapper, self.optimizer)

    def checkpoint_pieces(self) -> tuple[list[Piece], list[dict] | None]:
        """What this rank writes into a checkpoint, and (on global rank 0) the single-process optimizer's
        param groups. Replicas are equal: data-parallel rank 0 writes the rows each tensor-parallel rank
        owns (every tensor whole without tensor parallelism), the others nothing."""
        state = self.optimizer.state_dict()
        groups = state["param_groups"] if dist.get_rank() == 0 else None
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.mesh.dp_rank != 0:  # with experts split over ep: the first ep group writes its experts
            ep_writer = self.ep_group is not None and self.mesh.rank("edp") == 0
            return (expert_state.expert_pieces(self.module, params, state["state"]) if ep_writer else []), groups
        return (tp_state.model_pieces(self.module, self.tp_rank)
                + tp_state.optimizer_pieces(params, state["state"], self.tp_rank)), groups

    def load_state(self, model_state: Mapping, optimizer_state: dict) -> None:
        """Load the single-process model and optimizer state (lazy mappings from a checkpoint reader);
        with tensor parallelism each rank takes its rows of every tensor."""
        tp_state.load_model(self.module, model_state)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        full = materialized_optimizer_state(optimizer_state)
        self.optimizer.load_state_dict({"state": tp_state.local_optimizer_state(params, full["state"]),
                                        "param_groups": full["param_groups"]})

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on global rank 0 (a collective for sharded layouts)."""
        if self.ep_group is not None:
            return expert_state.gather_full_state(self.module, self.mesh.dp_rank, self.mesh.rank("edp"), self.tp_rank)
        if self.tp_size > 1:
            return tp_state.gather_full_state(self.module, self.tp_rank, active=self.mesh.dp_rank == 0)
        return self.module.state_dict()


class ZeroEngine(DataParallelEngine):
    """ZeRO-1/2/3: the optimizer steps this rank's slice; checkpoints gather the unsharded state."""

    def _build_module(self) -> Transformer:
        """ZeRO-3 builds the model on the meta device (buffers real): the wrapper materialises only this
        rank's slices, from the same ``(seed, name, shape)`` initialisation (:mod:`shardwise.parallel.zero.meta`)."""
        if self.cfg.parallel.zero != 3 or self.mesh.size("tp") > 1:  # tensor parallelism slices real weights
            return super()._build_module()
        with torch.device("meta"):
            module = Transformer(self.cfg.model)
        materialize_buffers(module, self.device)
        module.reset_parameters(self.cfg.train.seed)  # fills the buffers; meta parameters are skipped
        return module

    def _param_init(self):
        """The full initial value of one parameter of a meta-built model (``None``: the model is real)."""
        if not any(p.is_meta for p in self.module.parameters()):
            return None
        names = {id(p): n for n, p in self.module.named_parameters_for_init()}
        m, seed = self.cfg.model, self.cfg.train.seed
        return lambda _name, p: initial_value(names[id(p)], p.shape, seed, init_std=m.init_std, n_layers=m.n_layers)

    def _wrap(self, run_dir: Path):
        p = self.cfg.parallel
        return ZeroDataParallel(self.module, group=self.group, stage=p.zero, bucket_mb=p.bucket_mb,
                                unit_blocks=p.zero_unit, offload=p.offload,
                                offload_dir=p.offload_dir or str(run_dir / "offload"),
                                quant_weights=p.zero_quant_weights, quant_grads=p.zero_quant_grads,
                                hpz_size=p.zero_hpz, comm_stats=self.ledger["dp"],
                                param_init=self._param_init(), device=self.device)

    def _optimizer(self):
        return ZeroOptimizer(self.wrapper, build_optimizer(self.module, self.cfg.train))

    def describe(self) -> str:
        return super().describe() + f", zero={self.cfg.parallel.zero}"

    def unscale_and_clip(self, scaler: DynamicLossScaler | None, max_norm: float) -> tuple[bool, float]:
        tp_group = self.mesh.group("tp") if self.tp_size > 1 else None
        agree = self.group if tp_group is None else dist.group.WORLD  # every rank holds other pieces
        found_inf = scaler.unscale_(self.optimizer.master_params(), group=agree) if scaler else False
        return found_inf, self.wrapper.clip_grad_norm_(max_norm, tp_group)

    def checkpoint_pieces(self) -> tuple[list[Piece], list[dict] | None]:
        """Every rank writes the slices of the parameters and optimizer moments in its own shard;
        nothing is gathered."""
        pieces = zero_checkpoint_pieces(self.wrapper, self.optimizer, with_buffers=dist.get_rank() == 0)
        return pieces, zero_param_groups(self.optimizer) if dist.get_rank() == 0 else None

    def load_state(self, model_state: Mapping, optimizer_state: dict) -> None:
        """Each rank takes the slices of its new shard (resharding on load); tensors are read one at a time.
        With tensor parallelism each tensor is first cut to this rank's rows (:class:`tp_state.LocalView`)."""
        if self.tp_size > 1:
            infos = dict(self.module.named_parameters(remove_duplicate=False))
            model_state = tp_state.LocalView(model_state, infos.get)
            by_ref = {self.optimizer._ref_index[id(p)]: p for p in self.module.parameters()
                      if id(p) in self.optimizer._ref_index}
            optimizer_state = {"param_groups": optimizer_state["param_groups"],
                               "state": {int(i): tp_state.LocalView.of_tensor(st, by_ref.get(int(i)))
                                         for i, st in optimizer_state["state"].items()}}
        load_model_state(self.wrapper, model_state)
        self.optimizer.load_state_dict(optimizer_state)

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.wrapper.state_dict()  # a collective over the data-parallel group
        if self.tp_size > 1:
            return tp_state.gather_full_state(self.module, self.tp_rank, active=self.mesh.dp_rank == 0, state=state)
        return state


def build_engine(cfg: Config, mesh: Mesh, device: torch.device, run_dir: Path):
    """The engine for ``cfg``'s layout: pipeline when ``parallel.pp > 1``, ZeRO when ``parallel.zero``,
    else data parallel."""
    if cfg.parallel.pp > 1:
        from shardwise.train.pipeline_engine import PipelineEngine

        return PipelineEngine(cfg, mesh, device, run_dir)
    if cfg.parallel.zero:
        return ZeroEngine(cfg, mesh, device, run_dir)
    return DataParallelEngine(cfg, mesh, device, run_dir)
