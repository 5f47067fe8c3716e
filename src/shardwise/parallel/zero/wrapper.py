"""ZeRO stages 1, 2 and 3: sharded optimizer states, gradients and parameters.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20):

* **stage 1** (P_os, §5.1): every rank keeps the full parameters and full gradients, but the
  master weights and Adam moments of its own slice only. Gradients accumulate into flat
  per-bucket buffers; as each bucket completes in backward it is reduce-scattered in place
  (each rank receives the sum of its slice), the rank updates its slice, and the updated
  slices are all-gathered back into the full parameters. The flat gradient buffers stay
  allocated (``zero_grad`` zeroes them): they are part of every step's peak anyway, and
  re-allocating them each step cost a page fault per 4 KiB (bench/bench_zero.py).
* **stage 2** (P_os+g, §5.2): gradients are sharded too. Parameters are grouped into buckets
  (units) in reverse registration order; each gradient is accumulated straight into its unit's
  flat buffer for this backward (a tensor hook makes ``.grad`` a view of it first), and as soon
  as every gradient of a unit has been accumulated (a post-accumulate-grad hook, as in
  :mod:`shardwise.parallel.data`), the buffer is reduce-scattered -- asynchronously, while backward
  goes on, on every device (``overlap_reduce``; Megatron-Core's ``--overlap-grad-reduce``) -- and
  handed on to the next unit (:mod:`.reduce`).
* stages 1 and 2 then all-gather the updated parameters after the optimizer step; the next forward
  waits for each unit's gather only where a module first needs it (``overlap_param_gather``, :mod:`.gather`).
* **stage 3** (P_os+g+p, §5.3, and the FSDP design of Zhao et al. 2023, "PyTorch FSDP", §3):
  parameters live only as slices. Units are transformer blocks (``unit_blocks`` per unit) plus
  a *root* unit holding everything else (embeddings, final norm, head). A unit's parameters
  are all-gathered before its forward, freed after it, gathered again when the gradient of its
  output arrives (a tensor hook: the "pre-backward" hook), and freed as soon as its gradients
  are complete, before they are reduce-scattered (as FSDP2). The next unit's gather is launched
  asynchronously (prefetch) so it overlaps the current unit's compute, in forward and in backward.

On gloo the reduce-scatters and all-gathers are direct exchanges of blocks (:mod:`.exchange`):
gloo's own collectives of those two kinds were 2-4x slower than its all-reduce and broadcast,
which torch's DDP and ``ZeroRedundancyOptimizer`` use.

Gradient accumulation: inside ``no_sync()`` backward accumulates full-size ``.grad`` locally
and nothing is communicated (like torch DDP's ``no_sync`` and FSDP2's
``set_requires_gradient_sync(False)``); the last micro-batch reduces the sum. This makes
accumulation exactly equal to the unsharded run, at the cost of holding full gradients
between micro-batches.

Inside a pipeline gradients accumulate unsharded and ZeRO-3 units stay gathered until the flush
(:mod:`.pipeline`); stages 1-2 reduce-scatter each unit during its chunk's last backward where the schedule
allows it (:meth:`~.pipeline.PipelineFlush.final_backward`).

Gradient communication dtype (``reduce_dtype``, FSDP2's ``MixedPrecisionPolicy.reduce_dtype``): the flat
gradient is cast to it for the reduce-scatter only; accumulation over micro-batches stays in the flat buffers'
dtype (fp32 unless ``param_dtype``), the reduced slice keeps the wider of the two dtypes, the optimizer steps in fp32.

Mixed precision: the trainer keeps fp32 parameters and lets ``torch.autocast`` make the
low-precision compute copies, so by default the flat parameter buffers are fp32 and the master
weights are *views* of the rank's slice of them (no second copy). With ``param_dtype`` (e.g.
bf16) the flat buffers, gradients and communication are in that dtype and separate fp32 master
pieces hold the truth — the paper's mixed-precision layout (2 + 2 + K bytes per parameter).

Parameters without a gradient: as in torch DDP with ``find_unused_parameters`` (and
:mod:`shardwise.parallel.data`), a parameter with no gradient on some ranks contributes zeros
there; one that received no gradient on *any* rank in the step is skipped by the optimizer (its
master pieces get ``.grad = None``), so AdamW neither decays it nor moves its moments, exactly as
the unsharded run. Each rank records which parameters got a gradient (the post-accumulate hook)
and the flags are all-reduced (MAX) once per step, at the end of backward.

Expert parallelism (``expert_group``): expert weights (``p.ep_shard``, :mod:`shardwise.parallel.expert.dispatch`)
differ between the ranks of an ep group, so they form units of their own whose slices are spread over the
ranks holding the same experts (mesh axis ``edp``) -- torchtitan's "dp2ep" shards them with FSDP over the
same group -- while the dense weights' units are sliced over the whole data-parallel group. Every gradient
is divided by the data-parallel size (an expert's gradient already sums the tokens of its whole ep group,
as in :class:`~shardwise.parallel.data.DataParallel`), so each unit's reduce-scatter gives the
single-process average. ZeRO-3 gathers a block's dense unit around the block and its experts' unit
(the module holding them) around the experts, inside it.

Not supported: reentrant activation checkpointing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.counting import CommStats
from shardwise.parallel.data import _assign_buckets
from shardwise.parallel.grad_norm import clip_grad_norm
from shardwise.parallel.zero import exchange
from shardwise.parallel.zero.consolidate import full_model_state, load_full_model_state
from shardwise.parallel.zero.flat import FlatUnit
from shardwise.parallel.zero.gather import ParamGather
from shardwise.parallel.zero.hpz import NodePartition, node_groups
from shardwise.parallel.zero.meta import check_ranks_agree, structure_hash
from shardwise.parallel.zero.offload import MasterStore
from shardwise.parallel.zero.pipeline import PipelineFlush
from shardwise.parallel.zero.reduce import BufferPool, GradReduction, overlaps_reduce
from shardwise.parallel.zero.stage3 import Stage3Hooks


def _weak(engine: ZeroDataParallel, method: str, *bound) -> Callable:
    """A hook calling ``engine.method(*bound, *args)`` that does not keep the engine alive (a tensor
    hook, given the gradient, gets ``bound`` only: its return value would replace the gradient)."""
    ref = weakref.ref(engine)

    def call(*args):
        owner = ref()
        if owner is not None:
            return getattr(owner, method)(*bound) if bound else getattr(owner, method)(*args)
        return None

    return call


def _blocks_of(chunk: nn.Module) -> list[nn.Module]:
    """A model's (``ModuleList``) or a pipeline stage's (``ModuleDict`` by layer id) transformer blocks."""
    blocks = chunk.blocks
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def block_units(blocks: list, unit_blocks: int) -> list[list]:
    """ZeRO-3's units of a model's blocks: runs of ``unit_blocks`` consecutive blocks, in order (the root unit
    holds every parameter outside them). Also what the simulator gathers (:mod:`shardwise.sim`)."""
    return [blocks[i:i + unit_blocks] for i in range(0, len(blocks), unit_blocks)]


class ZeroDataParallel(GradReduction, ParamGather, Stage3Hooks, PipelineFlush, nn.Module):
    """Shard ``module``'s training state over ``group`` with ZeRO stage ``stage`` (1, 2 or 3).

    Use with :class:`shardwise.parallel.zero.ZeroOptimizer`, which steps the rank's master
    pieces and puts the result back into the parameters. ``engine(x, y)`` runs the module;
    after the last ``backward()`` of a step, the master pieces' ``.grad`` hold the averaged
    gradient slice; ``clip_grad_norm_`` clips across shards.

    Args:
        module: the model, already on its device; its parameters become views of flat buffers.
            Its parameters may be on the meta device (buffers must be real: :func:`.meta.materialize_buffers`);
            ``param_init`` then computes them, each rank only what it keeps (:mod:`.meta`).
        group: data-parallel process group (``None``: default group).
        stage: 1, 2 or 3.
        bucket_mb: unit size for stages 1 and 2 (MiB).
        unit_modules: for stage 3, the modules that are each a unit (default: ``module.blocks``
            grouped by ``unit_blocks``); everything else forms the root unit.
        unit_blocks: blocks per unit for the default stage-3 units.
        param_dtype: dtype of the flat parameters and gradients (default: the parameters' own).
        offload: "none", "cpu" (fp32 master pieces and optimizer step on CPU) or "disk"
            (master pieces and moments in memory-mapped files under ``offload_dir``).
        quant_weights: stage 3: all-gather parameters as int8 blocks (ZeRO++ qwZ, :mod:`.quant`).
        quant_grads: reduce-scatter gradients as int8 blocks via all-to-all (ZeRO++ qgZ).
        hpz_size: stage 3: keep a secondary partition of each unit's gathered parameters over
            subgroups of ``hpz_size`` consecutive ranks, so backward gathers stay inside a node
            (ZeRO++ hpZ, :mod:`.hpz`); 1 = off.
        hpz_group: this rank's node subgroup for ``hpz_size`` (default: built here, which needs
            ``group`` to span the world).
        node_size: ranks per node for the intra/inter-node split of ``gather_traffic``
            (default ``hpz_size``).
        overlap_reduce: let each reduce-scatter run while backward goes on (default: stages 1 and 2 on
            every device -- on gloo the direct exchange's messages travel on gloo's transport threads while
            the compute thread goes on (:mod:`.exchange`); stage 3 on CUDA only: on CPU gloo's worker threads
            compete with the compute for the same cores, and a unit-sized staging buffer (plus gloo's own
            copy of it) in flight through the next unit's backward raised ZeRO-3's peak memory above
            ``fully_shard``'s (which waits too on CPU), while waiting cost no time there, bench/bench_zero.py).
            False: wait for each reduce-scatter as soon as it is launched.
        overlap_param_gather: stages 1-2: launch the all-gather of the updated parameters after the step
            and let each module's forward pre-hook wait only for its own units (:mod:`.gather`); False: wait
            for every gather in ``after_step``.
        reduce_dtype: dtype the gradients are reduce-scattered in (e.g. ``torch.bfloat16``; default: the flat
            gradients' own); micro-batches accumulate in the flat buffers' dtype, the reduced slice is kept in the
            wider of the two (fp32 beside bf16 flat gradients), and the optimizer steps fp32 masters.
        param_init: for parameters on the meta device, ``param_init(name, param)`` returns the full
            initial value of one parameter (``name`` as in ``module.named_parameters()``), the same on
            every rank; ZeRO-3 keeps only this rank's slices, so the full model is never in memory, and
            nothing is broadcast (:mod:`.meta`).
        device: where meta parameters are materialised (default: CPU).
        expert_group: with expert parallelism, the ranks holding the same experts: parameters marked
            ``p.ep_shard`` form units sliced over it (at stage 3, one per MoE block).
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, stage: int = 1, *,
                 bucket_mb: float = 25.0, unit_modules: list[nn.Module] | None = None, unit_blocks: int = 1,
                 param_dtype: torch.dtype | None = None, offload: str = "none", offload_dir: str | None = None,
                 quant_weights: bool = False, quant_grads: bool = False, broadcast_from: int = 0,
                 hpz_size: int = 1, hpz_group: dist.ProcessGroup | None = None, node_size: int | None = None,
                 overlap_reduce: bool | None = None, overlap_param_gather: bool = True,
                 reduce_dtype: torch.dtype | None = None, comm_stats: CommStats | None = None,
                 param_init: Callable[[str, nn.Parameter], torch.Tensor] | None = None,
                 device: torch.device | str | None = None, expert_group: dist.ProcessGroup | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage}: ZeroDataParallel implements stages 1, 2 and 3")
        if hpz_size != 1 and stage != 3:
            raise ValueError(f"hpz_size={hpz_size} partitions ZeRO-3's parameters; use stage=3 or hpz_size=1")
        self.module = module
        self.group = group
        self.expert_group = expert_group
        self.stage = stage
        self.chunks = list(module) if isinstance(module, nn.ModuleList) else [module]
        """The modules a caller runs: the model, or a pipeline rank's chunks (an ``nn.ModuleList``)."""
        self._hold = False
        """Inside :meth:`pipeline_step`: gradients accumulate unsharded, ZeRO-3 units stay gathered."""
        self.flush_bytes: dict[str, int] = {}
        """Measured at the last pipeline flush (:meth:`reduce_gradients`) -- or, where a chunk's last backward began
        reducing units before it (:meth:`final_backward`), at that moment, the step's peak -- from storages:
        ``gathered`` (ZeRO-3's units held gathered) and ``grad_accum`` (stages 2-3's gradients accumulated
        unsharded)."""
        self.quant_weights, self.quant_grads = quant_weights, quant_grads
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.comm_stats = comm_stats if comm_stats is not None else CommStats()
        """Where every collective of the engine is recorded (:mod:`shardwise.dist.comm.counting`)."""
        if hpz_size > 1 and hpz_group is None:
            hpz_group = node_groups(group, hpz_size)
        report = node_size or hpz_size
        if self.world % report:
            raise ValueError(f"node_size={report} must divide the data-parallel size {self.world}")
        self.hpz = NodePartition(hpz_group if hpz_size > 1 else None, report, self.world,
                                 dist.get_process_group_ranks(group) if group is not None else None)
        self._sync = True
        src = dist.get_global_rank(group, broadcast_from) if group is not None else broadcast_from
        named: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        groups = self._unit_groups(named, stage, bucket_mb, unit_modules, unit_blocks)
        self._check_meta(module, named, param_init)
        on_meta = any(p.is_meta for _, p in named)
        if device is None:
            device = next((p.device for _, p in named if not p.is_meta), torch.device("cpu"))
        device = torch.device(device)
        if self.world > 1 and on_meta:  # before any collective that a mismatch would hang
            check_ranks_agree([], structure_hash(named), group, device)
        self.units = []
        for i, g in enumerate(groups):  # one unit at a time, so that at most one full copy is extra
            ugroup, usrc = group, src
            if self._is_expert(g[0][1]):  # expert weights: sliced over (and started from) their own replicas
                ugroup, usrc = expert_group, dist.get_global_rank(expert_group, 0)
            uworld = dist.get_world_size(ugroup)
            if uworld > 1:  # replicas start from rank ``broadcast_from``'s weights (in place)
                for _, p in g:
                    if not p.is_meta:  # meta parameters: every rank computes the same values
                        dist.broadcast(p.data, src=usrc, group=ugroup)
            # stage 3 keeps its own slice apart from the full buffer, which stays unallocated
            self.units.append(FlatUnit(i, [n for n, _ in g], [p for _, p in g], dist.get_rank(ugroup), uworld,
                                       param_dtype, sharded=stage == 3, init=param_init, device=device,
                                       group=ugroup))
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        if self.world > 1 and on_meta:
            check_ranks_agree(self.units, structure_hash(named), group, device)
        if self.world > 1:
            for b in module.buffers():
                dist.broadcast(b.view(torch.uint8) if b.dtype == torch.bool else b, src=src, group=group)
        for u in self.units:
            u.grad_shard = None
            u.grad_full = torch.zeros_like(u.full) if stage == 1 else None
            if stage == 1:  # gradients accumulate straight into the flat buffer (no second copy)
                for p, off, n in zip(u.params, u.offsets, u.numels, strict=True):
                    p.grad = u.grad_full[off:off + n].view(p.shape)
        # files named by the global rank: other stages' and tensor-parallel ranks share a data-parallel rank
        self.masters = MasterStore(self.units, offload, offload_dir, dist.get_rank())
        self._grad_pool = BufferPool(keep={1: 1, 2: 2, 3: 0}[stage])
        """Flat gradients and exchange scratch kept for reuse (stage 1: a scratch; 2: two units; 3: none, so
        that memory follows the units as in FSDP)."""
        self._params = [p for u in self.units for p in u.params]
        self._position = {id(p): i for u in self.units for i, p in enumerate(u.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(_weak(self, "_on_grad_ready")) for p in self._params]
        if stage > 1:  # gradients are accumulated straight into each unit's flat buffer
            self._hooks += [p.register_hook(_weak(self, "_into_flat_grad", i)) for i, p in enumerate(self._params)]
        if stage == 3:
            for u, (first, last) in zip(self.block_units, self._stage3_modules, strict=True):
                self._hooks.append(first.register_forward_pre_hook(_weak(self, "_unit_pre_forward_hook")))
                self._hooks.append(last.register_forward_hook(_weak(self, "_unit_post_forward_hook")))
                self._module_unit[(id(first), "pre")] = u
                self._module_unit[(id(last), "post")] = u
            for chunk in self.chunks:  # the root is gathered as each chunk starts; its first unit is prefetched
                inside = {id(m) for m in chunk.modules()}
                firsts = [u for u, (first, _) in zip(self.block_units, self._stage3_modules, strict=True)
                          if id(first) in inside]
                self._chunk_first_unit[id(chunk)] = firsts[0] if firsts else None
                self._hooks.append(chunk.register_forward_pre_hook(_weak(self, "_root_pre_forward")))
                self._hooks.append(chunk.register_forward_hook(_weak(self, "_root_post_forward")))
        self._had_grad = bytearray(sum(len(u.params) for u in self.units))
        """Per parameter (units in order): did it receive a gradient this step on this rank."""
        self.direct_exchange = self.world > 1 and exchange.use_exchange(group, self.units[0].shard)
        """Reduce-scatter and all-gather by direct exchange (:mod:`.exchange`): gloo's own are slower."""
        if overlap_reduce is None:
            overlap_reduce = overlaps_reduce(stage, self.units[0].shard.is_cuda)
        self.overlap_reduce = overlap_reduce
        self.overlap_param_gather = overlap_param_gather
        self.reduce_dtype = reduce_dtype
        self._final = False
        self._reduced_early = 0
        self.overlapped_units_last_step = 0
        """Units whose reduce-scatter the last step launched during backward, before its end (or its flush)."""
        self._held_at_first: dict[str, int] | None = None
        """Inside :meth:`final_backward` (a pipeline chunk's last backward): gradients completed there are final."""
        self._late: set[int] = {id(self._unit_of[id(w)]) for c in self.chunks
                                if (w := getattr(c, "tied_weight", None)) is not None and id(w) in self._unit_of}
        """Units a pipeline changes after its last backward (the tied table's copies add their gradients after
        the flush): reduced only in :meth:`reduce_gradients`."""
        self._flag_index = {id(p): i for i, p in enumerate(p for u in self.units for p in u.params)}
        # reduce-scatter order: buckets as built (reverse registration), ZeRO-3 units last block first
        self._order = list(reversed(self.units)) if stage == 3 else list(self.units)
        self._reset()
        self._install_gather_hooks()

    @staticmethod
    def _check_meta(module: nn.Module, named, param_init) -> None:
        """Meta parameters need ``param_init``; meta buffers and frozen meta parameters are not materialised here."""
        if param_init is None and any(p.is_meta for _, p in named):
            raise ValueError("ZeroDataParallel: the module's parameters are on the meta device; pass param_init")
        sharded = {id(p) for _, p in named}
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_meta and id(t) not in sharded:
                raise ValueError(f"ZeroDataParallel: {name} is on the meta device but is not a trained parameter; "
                                 "materialise buffers first (shardwise.parallel.zero.meta.materialize_buffers)")

    def _is_expert(self, p: nn.Parameter) -> bool:
        """Whether ``p`` is sliced over the expert group (an expert-parallel shard)."""
        return self.expert_group is not None and getattr(p, "ep_shard", None) is not None

    def _unit_groups(self, named, stage, bucket_mb, unit_modules, unit_blocks):
        if stage < 3:
            cap = max(int(bucket_mb * 2**20), 1)
            ids = {id(p): (n, p) for n, p in named}
            buckets = _assign_buckets([p for _, p in named], cap, kind=self._is_expert)  # torch DDP's cut
            return [[ids[id(p)] for p in b] for b in buckets]
        if unit_modules is None:  # a unit never spans two chunks: they run at different times
            unit_modules = [unit for blocks in map(_blocks_of, self.chunks)
                            for unit in block_units(blocks, unit_blocks)]
        if self.expert_group is not None:  # each group's expert modules follow it as a unit of their own
            unit_modules = [u for mods in unit_modules for u in [mods, *self._expert_modules(mods)]]
        self._stage3_modules: list[tuple[nn.Module, nn.Module]] = []
        self._module_unit: dict[tuple[int, str], FlatUnit] = {}
        self._chunk_first_unit: dict[int, FlatUnit | None] = {}
        owner = {id(p): n for n, p in named}
        taken: set[int] = set()
        groups = []
        for mods in unit_modules:
            mods = list(mods) if isinstance(mods, (list, tuple, nn.ModuleList)) else [mods]
            experts = all(self._is_expert(p) for m in mods for p in m.parameters())
            g = [(owner[id(p)], p) for m in mods for p in m.parameters()
                 if id(p) in owner and id(p) not in taken and self._is_expert(p) == experts]
            taken.update(id(p) for _, p in g)
            groups.append(g)
            self._stage3_modules.append((mods[0], mods[-1]))
        root = [(n, p) for n, p in named if id(p) not in taken]
        self._has_root = bool(root)  # a middle pipeline stage holds blocks only
        return [root] + groups if root else groups

    def _expert_modules(self, mods) -> list[nn.Module]:
        """The outermost modules inside ``mods`` holding only expert shards (one per MoE block)."""
        mods = list(mods) if isinstance(mods, (list, tuple, nn.ModuleList)) else [mods]
        found: list[nn.Module] = []
        for m in (sub for top in mods for sub in top.modules()):
            params = list(m.parameters())
            if params and all(self._is_expert(p) for p in params) and \
                    not any(m is f or any(m is d for d in f.modules()) for f in found):
                found.append(m)
        return found

    # ---- during backward ---------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full ``.grad`` locally, without communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def forward(self, *args, **kwargs):
        if self._in_backward:  # the previous backward died half-way
            self._reset()
        return self.module(*args, **kwargs)

    # ---- optimizer side ----------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Forget the step's gradients (stage 1: zero its flat gradient buffers, which stay allocated)."""
        for u in self.units:
            u.grad_shard = None
            if u.grad_full is not None:
                u.grad_full.zero_()
        self._had_grad = bytearray(len(self._had_grad))
        self.masters.zero_grad()

    def grad_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """``(gradient slice, its parameter)`` for every master piece with a gradient this step."""
        return [(m.grad, u.params[pc.param_index]) for u, pc, m in self.masters.entries if m.grad is not None]

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The group whose ranks hold the slices of the gradient (:mod:`shardwise.parallel.grad_norm`)."""
        return self.group or dist.group.WORLD

    def clip_grad_norm_(self, max_norm: float, tp_group: dist.ProcessGroup | None = None,
                        pp_group: dist.ProcessGroup | None = None, skip: frozenset[int] = frozenset()) -> float:
        """Global L2 norm of the gradient over all shards (and, when given, over the tensor-parallel and
        pipeline groups; ``skip``: parameters another stage counts), clipped to ``max_norm`` as
        ``torch.nn.utils.clip_grad_norm_`` would on the full gradient (:mod:`shardwise.parallel.grad_norm`)."""
        return clip_grad_norm(self.grad_pieces(), max_norm, tp_group=tp_group,
                              shard_group=self.group or dist.group.WORLD, pp_group=pp_group, skip=skip,
                              device=self.units[0].shard.device)

    # ---- checkpoints: the unsharded model's state dict, gathered / sliced ---------------------

    def state_dict(self, *args, **kwargs):  # noqa: D102 - a collective: every rank must call it
        self.wait_for_params()
        return full_model_state(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: D102
        self.wait_for_params()  # a gather still in flight would overwrite what is loaded
        missing, unexpected = load_full_model_state(self, state_dict)
        if strict and (missing or unexpected):
            raise RuntimeError(f"state dict does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
        return missing, unexpected

    def pop_gather_traffic(self) -> dict[str, int]:
        """Bytes this rank sent in parameter gathers since the last call, by phase and by whether they
        went to its node (``node_size`` ranks) or crossed a node boundary, counted at every send; and
        ``backend_gather_bytes``, handed to gathers the backend runs (:mod:`.hpz`)."""
        return self.hpz.pop_traffic()

    def model_state_bytes(self) -> dict[str, int]:
        """Capacity of this rank's parameter, gradient and master-weight buffers across a step
        (padded; see :mod:`shardwise.train.memory`). ``params`` includes the hpZ secondary
        partitions, held from a unit's forward to its backward."""
        params = grads = 0
        for u in self.units:
            elt = u.full.element_size()
            params += (u.shard_numel if self.stage == 3 else u.padded_numel) * elt
            grads += (u.padded_numel if self.stage == 1 else u.shard_numel) * elt
        return {"params": params + self.hpz.nbytes(self.units), "grads": grads, "master": self.masters.nbytes()}
