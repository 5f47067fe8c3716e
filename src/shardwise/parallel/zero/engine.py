"""ZeRO stages 1, 2 and 3: sharded optimizer states, gradients and parameters.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20):

* **stage 1** (P_os, §5.1): every rank keeps the full parameters and full gradients, but the
  master weights and Adam moments of its own slice only. Gradients accumulate into flat
  per-bucket buffers; as each bucket completes in backward it is reduce-scattered in place
  (each rank receives the sum of its slice), the rank updates its slice, and the updated
  slices are all-gathered back into the full parameters. The full gradients are released at
  ``zero_grad`` and re-allocated by the next forward.
* **stage 2** (P_os+g, §5.2): gradients are sharded too. Parameters are grouped into buckets
  (units) in reverse registration order; as soon as every gradient of a unit has been
  accumulated (a post-accumulate-grad hook, as in :mod:`shardwise.parallel.data`), the unit's
  gradients are reduce-scattered asynchronously and the full-size gradients are freed, while
  backward goes on.
* **stage 3** (P_os+g+p, §5.3, and the FSDP design of Zhao et al. 2023, "PyTorch FSDP", §3):
  parameters live only as slices. Units are transformer blocks (``unit_blocks`` per unit) plus
  a *root* unit holding everything else (embeddings, final norm, head). A unit's parameters
  are all-gathered before its forward, freed after it, gathered again when the gradient of its
  output arrives (a tensor hook: the "pre-backward" hook), and freed after its gradients are
  reduce-scattered. The next unit's gather is launched asynchronously (prefetch) so it
  overlaps the current unit's compute, in forward and in backward.

Gradient accumulation: inside ``no_sync()`` backward accumulates full-size ``.grad`` locally
and nothing is communicated (like torch DDP's ``no_sync`` and FSDP2's
``set_requires_gradient_sync(False)``); the last micro-batch reduces the sum. This makes
accumulation exactly equal to the unsharded run, at the cost of holding full gradients
between micro-batches.

Mixed precision: the trainer keeps fp32 parameters and lets ``torch.autocast`` make the
low-precision compute copies, so by default the flat parameter buffers are fp32 and the master
weights are *views* of the rank's slice of them (no second copy). With ``param_dtype`` (e.g.
bf16) the flat buffers, gradients and communication are in that dtype and separate fp32 master
pieces hold the truth — the paper's mixed-precision layout (2 + 2 + K bytes per parameter).

Not supported: parameters that receive no gradient on any rank are treated as zero gradients
(weight decay and moments still update them, unlike an unsharded run where they are skipped);
reentrant activation checkpointing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.data import _assign_buckets
from shardwise.parallel.zero.flat import FlatUnit
from shardwise.parallel.zero.offload import MasterStore
from shardwise.parallel.zero.quant import reduce_scatter_int8
from shardwise.parallel.zero.stage3 import Stage3Hooks


def _weak(engine: ZeroDataParallel, method: str) -> Callable:
    ref = weakref.ref(engine)

    def call(*args):
        owner = ref()
        if owner is not None:
            return getattr(owner, method)(*args)
        return None

    return call


class ZeroDataParallel(Stage3Hooks, nn.Module):
    """Shard ``module``'s training state over ``group`` with ZeRO stage ``stage`` (1, 2 or 3).

    Use with :class:`shardwise.parallel.zero.ZeroOptimizer`, which steps the rank's master
    pieces and puts the result back into the parameters. ``engine(x, y)`` runs the module;
    after the last ``backward()`` of a step, the master pieces' ``.grad`` hold the averaged
    gradient slice; ``clip_grad_norm_`` clips across shards.

    Args:
        module: the model, already on its device; its parameters become views of flat buffers.
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
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, stage: int = 1, *,
                 bucket_mb: float = 25.0, unit_modules: list[nn.Module] | None = None, unit_blocks: int = 1,
                 param_dtype: torch.dtype | None = None, offload: str = "none", offload_dir: str | None = None,
                 quant_weights: bool = False, quant_grads: bool = False, broadcast_from: int = 0):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage}: ZeroDataParallel implements stages 1, 2 and 3")
        self.module = module
        self.group = group
        self.stage = stage
        self.quant_weights, self.quant_grads = quant_weights, quant_grads
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.comm_bytes_last_step = 0
        """Bytes handed to collectives in the last step (reduce-scatter inputs plus gathers)."""
        self._sync = True
        src = dist.get_global_rank(group, broadcast_from) if group is not None else broadcast_from
        named: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        groups = self._unit_groups(named, stage, bucket_mb, unit_modules, unit_blocks)
        self.units = []
        for i, g in enumerate(groups):  # one unit at a time, so that at most one full copy is extra
            if self.world > 1:  # replicas start from rank ``broadcast_from``'s weights (in place)
                for _, p in g:
                    dist.broadcast(p.data, src=src, group=group)
            # stage 3 keeps its own slice apart from the full buffer, which stays unallocated
            self.units.append(FlatUnit(i, [n for n, _ in g], [p for _, p in g], self.rank, self.world, param_dtype,
                                       sharded=stage == 3))
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        if self.world > 1:
            for b in module.buffers():
                dist.broadcast(b.view(torch.uint8) if b.dtype == torch.bool else b, src=src, group=group)
        for u in self.units:
            u.grad_shard = None
            u.grad_full = torch.zeros_like(u.full) if stage == 1 else None
            if stage == 1:  # gradients accumulate straight into the flat buffer (no second copy)
                for p, off, n in zip(u.params, u.offsets, u.numels, strict=True):
                    p.grad = u.grad_full[off:off + n].view(p.shape)
        self.masters = MasterStore(self.units, offload, offload_dir, self.rank)
        self._hooks = [p.register_post_accumulate_grad_hook(_weak(self, "_on_grad_ready"))
                       for u in self.units for p in u.params]
        if stage == 1:  # full gradients exist from the forward that makes them until zero_grad (§5.1)
            self._hooks.append(module.register_forward_pre_hook(_weak(self, "_stage1_pre_forward")))
        if stage == 3:
            self._hooks.append(module.register_forward_pre_hook(_weak(self, "_root_pre_forward")))
            self._hooks.append(module.register_forward_hook(_weak(self, "_root_post_forward")))
            for u, (first, last) in zip(self.units[1:], self._stage3_modules, strict=True):
                self._hooks.append(first.register_forward_pre_hook(_weak(self, "_unit_pre_forward_hook")))
                self._hooks.append(last.register_forward_hook(_weak(self, "_unit_post_forward_hook")))
                self._module_unit[(id(first), "pre")] = u
                self._module_unit[(id(last), "post")] = u
        self._reset()

    def _unit_groups(self, named, stage, bucket_mb, unit_modules, unit_blocks):
        if stage < 3:
            cap = max(int(bucket_mb * 2**20), 1)
            ids = {id(p): (n, p) for n, p in named}
            buckets = _assign_buckets([p for _, p in named], cap)
            return [[ids[id(p)] for p in b] for b in buckets]
        if unit_modules is None:
            blocks = list(self.module.blocks)
            unit_modules = [blocks[i:i + unit_blocks] for i in range(0, len(blocks), unit_blocks)]
        self._stage3_modules: list[tuple[nn.Module, nn.Module]] = []
        self._module_unit: dict[tuple[int, str], FlatUnit] = {}
        owner = {id(p): n for n, p in named}
        taken: set[int] = set()
        groups = []
        for mods in unit_modules:
            mods = list(mods) if isinstance(mods, (list, tuple, nn.ModuleList)) else [mods]
            g = [(owner[id(p)], p) for m in mods for p in m.parameters() if id(p) in owner and id(p) not in taken]
            taken.update(id(p) for _, p in g)
            groups.append(g)
            self._stage3_modules.append((mods[0], mods[-1]))
        root = [(n, p) for n, p in named if id(p) not in taken]
        return [root] + groups

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

    def _reset(self) -> None:
        self._in_backward = False
        self._inflight: list[tuple[FlatUnit, torch.Tensor, torch.Tensor, dist.Work | None]] = []
        for u in self.units:
            u.pending = len(u.params)
            u.reduced = False

    def _start_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._start_backward()
        unit = self._unit_of[id(param)]
        unit.pending -= 1
        if unit.pending == 0:
            if self._sync and self.stage == 1:  # overlapped with the rest of backward, in place
                self._stage1_flatten(unit)
                self._launch(unit, unit.grad_full)
            elif self._sync:
                self._reduce_scatter(unit)
            if unit.index > 0 or self.stage < 3:
                self._free(unit)

    def _reduce_scatter(self, unit: FlatUnit) -> None:
        """Stages 2/3: launch the reduce-scatter of one unit's gradients and free the full-size ones."""
        flat = unit.flat_grad(self.world)
        for p in unit.params:
            p.grad = None
        self._launch(unit, flat)

    def _launch(self, unit: FlatUnit, flat: torch.Tensor) -> None:
        """Reduce-scatter ``flat`` (a unit's divided gradients). Stage 1 reduces in place: the
        output is the rank's own slice of the input (NCCL's documented in-place form; gloo
        computes the same, which the equivalence tests check), so no extra gradient shard exists."""
        unit.reduced = True
        if self.world == 1:
            self._inflight.append((unit, flat, flat, None))
            return
        if self.stage == 1:
            out = unit.own_slice(flat)
        else:
            out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
        if self.quant_grads:
            work, nbytes = reduce_scatter_int8(out, flat, self.group)
            self.comm_bytes_last_step += nbytes
        else:
            work = dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self.comm_bytes_last_step += flat.numel() * flat.element_size()
        self._inflight.append((unit, flat, out, work))
        if self.stage > 1:  # bound the staging buffers alive at once (each holds a whole unit)
            self._drain(keep=1)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End-of-backward callback: reduce what is left, wait, hand each master piece its gradient."""
        try:
            if self._sync:
                for u in self.units:
                    if u.reduced:
                        continue
                    if self.stage == 1:
                        self._stage1_flatten(u)
                        self._launch(u, u.grad_full)
                    else:
                        self._reduce_scatter(u)
                self._drain(keep=0)
                self.masters.set_grads(self.units)
            if self.stage == 3:
                for u in self.units:
                    self._free(u)
        finally:
            self._reset()

    def _drain(self, keep: int) -> None:
        """Wait for the oldest reduce-scatters until at most ``keep`` are in flight; add each result
        into its unit's gradient shard and release the staging buffer."""
        while len(self._inflight) > keep:
            u, _flat, out, work = self._inflight.pop(0)
            if work is not None:
                work.wait()
            if self.stage == 1 or u.grad_shard is None:
                u.grad_shard = out
            else:
                u.grad_shard += out

    def _stage1_flatten(self, u: FlatUnit) -> None:
        """Stage 1: make each ``.grad`` a view of the unit's persistent flat gradient, divided by N."""
        for p, off, n in zip(u.params, u.offsets, u.numels, strict=True):
            view = u.grad_full[off:off + n].view(p.shape)
            if p.grad is None:
                continue
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        u.grad_full.div_(self.world)

    # ---- optimizer side ----------------------------------------------------------------------

    def _stage1_pre_forward(self, _module, _args) -> None:
        """Stage 1: give the flat gradient buffers (and so every ``.grad`` view) their memory back."""
        if torch.is_grad_enabled():
            for u in self.units:
                if u.grad_full.untyped_storage().nbytes() == 0:
                    u.grad_full.untyped_storage().resize_(u.padded_numel * u.grad_full.element_size())
                    u.grad_full.zero_()

    def zero_grad(self) -> None:
        """Forget the step's gradients; stage 1 releases its full gradient buffers until the next forward."""
        for u in self.units:
            u.grad_shard = None
            if u.grad_full is not None:
                u.grad_full.untyped_storage().resize_(0)
        self.masters.zero_grad()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm of the gradient over all shards (sum of squares all-reduced), clipped
        to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` would on the full gradient."""
        grads = [m.grad for m in self.masters.params() if m.grad is not None]
        device = self.units[0].shard.device  # the collective's device (a GPU with NCCL)
        local = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            local = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum().to(device)
        if self.world > 1:
            dist.all_reduce(local, group=self.group)
        total = local.sqrt()
        if max_norm > 0 and grads:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return float(total)

    @torch.no_grad()
    def after_step(self) -> None:
        """Write the updated master pieces into the shards and (stages 1, 2) all-gather the full parameters."""
        self.masters.write_back(self.units)
        if self.stage == 3 or self.world == 1:
            return
        works = []
        for u in self.units:
            works.append(dist.all_gather_single(u.full, u.shard.clone(), group=self.group, async_op=True))
            self.comm_bytes_last_step += u.param_bytes_full()
        for w in works:
            w.wait()

    # ---- checkpoints: the unsharded model's state dict, gathered / sliced ---------------------

    def state_dict(self, *args, **kwargs):  # noqa: D102 - a collective: every rank must call it
        from shardwise.parallel.zero.optim import full_model_state
        return full_model_state(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: D102
        from shardwise.parallel.zero.optim import load_full_model_state
        missing, unexpected = load_full_model_state(self, state_dict)
        if strict and (missing or unexpected):
            raise RuntimeError(f"state dict does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
        return missing, unexpected

    def pop_comm_bytes(self) -> int:
        n, self.comm_bytes_last_step = self.comm_bytes_last_step, 0
        return n
