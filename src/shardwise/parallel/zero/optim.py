"""The sharded optimizer and the layout-independent ("consolidated") state of a ZeRO run.

:class:`ZeroOptimizer` takes the optimizer an unsharded run would use (e.g. the AdamW of
``shardwise.train.optim.build_optimizer``) as a *reference*: it keeps its class, hyper-parameters
and parameter groups, but steps only this rank's master pieces (Rajbhandari et al. 2020, §5.1:
each rank updates its 1/N of the optimizer state). Element-wise optimizers (Adam, AdamW, SGD)
compute exactly what the reference would on those elements.

Checkpoints are *consolidated*: ``state_dict()`` (a collective) all-gathers every slice and
returns what the reference optimizer's ``state_dict()`` would hold after the same steps, and
:func:`~shardwise.parallel.zero.consolidate.full_model_state` returns the plain model state dict.
Loading slices these full tensors for the current layout, so a checkpoint resumes on any
number of data-parallel ranks, any ZeRO stage, or without ZeRO at all (resharding on load). The
price is one full copy of the state in each rank's memory while saving or loading.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from shardwise.parallel.zero.consolidate import gather_flat
from shardwise.parallel.zero.wrapper import ZeroDataParallel


class ZeroOptimizer:
    """Step this rank's master pieces with the reference optimizer's algorithm and settings.

    ``param_groups`` mirrors the reference's groups (so learning-rate schedules work unchanged);
    ``step()`` updates the pieces and then lets the engine write them back and all-gather.
    """

    def __init__(self, engine: ZeroDataParallel, reference: torch.optim.Optimizer):
        self.engine = engine
        self.reference_groups = [list(g["params"]) for g in reference.param_groups]
        self._ref_index: dict[int, int] = {}
        for p in (p for g in self.reference_groups for p in g):
            self._ref_index.setdefault(id(p), len(self._ref_index))
        group_of = {id(p): gi for gi, g in enumerate(self.reference_groups) for p in g}
        pieces: list[list[torch.Tensor]] = [[] for _ in reference.param_groups]
        self._entries = []  # (reference index, piece, master)
        for u, pc, m in engine.masters.entries:
            p = u.params[pc.param_index]
            pieces[group_of[id(p)]].append(m)
            self._entries.append((self._ref_index[id(p)], u, pc, m))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                  for g, ps in zip(reference.param_groups, pieces, strict=True)]
        accepted = inspect.signature(type(reference)).parameters
        self.inner = type(reference)(groups, **{k: v for k, v in reference.defaults.items() if k in accepted})

    @property
    def param_groups(self):
        return self.inner.param_groups

    def master_params(self) -> list[torch.Tensor]:
        return self.engine.masters.params()

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """Step the master pieces, then write them back (and all-gather). ``found_inf``: a 0-dim flag tensor;
        where it is nonzero the reference optimizer (a fused torch optimizer, as ``torch.amp.GradScaler``
        drives it) leaves every piece and its state as they were -- decided on the device, read by no host."""
        if found_inf is not None:
            self._hand_to_masters(found_inf)
        try:
            if self.engine.masters.disk is not None:
                self._streamed_step()
            else:
                self.inner.step()
        finally:
            self.inner.__dict__.pop("found_inf", None)
        self.engine.after_step()

    def _hand_to_masters(self, found_inf: torch.Tensor) -> None:
        """The skip flag, and a learning rate held as a tensor, on the masters' device. Masters offloaded to the
        host from a GPU get copies that wait for the device (a non-blocking copy would be read unfinished)."""
        masters = self.master_params()
        device = masters[0].device if masters else found_inf.device
        self.inner.found_inf = found_inf.to(device)
        for g in self.inner.param_groups:
            if isinstance(g["lr"], torch.Tensor) and g["lr"].device != device:
                g["lr"] = g["lr"].to(device, torch.float64 if device.type == "cpu" else torch.float32)

    def _streamed_step(self) -> None:
        """Disk offload (ZeRO-Infinity §5): step one unit at a time — stream its master pieces and
        optimizer states in, let the reference algorithm update them, write them back — so only
        one unit's optimizer state is in memory at once."""
        everything = [g["params"] for g in self.inner.param_groups]
        try:
            for u in self.engine.units:
                mine = {id(m) for _, uu, _, m in self._entries if uu is u}
                if not mine:
                    continue
                with self.engine.masters.resident(u, self.inner.state, write=True):
                    for g, params in zip(self.inner.param_groups, everything, strict=True):
                        g["params"] = [p for p in params if id(p) in mine]
                    self.inner.step()
        finally:
            for g, params in zip(self.inner.param_groups, everything, strict=True):
                g["params"] = params

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors with one element per parameter element (Adam's moments);
        with disk offload, the bytes of their files."""
        if self.engine.masters.disk is not None:
            return sum(pc.numel * 4 * len(self.engine.masters.disk.state_kinds[u.index])
                       for _, u, pc, _ in self._entries)
        return sum(v.numel() * v.element_size() for m in self.master_params()
                   for v in self.inner.state.get(m, {}).values()
                   if isinstance(v, torch.Tensor) and v.numel() == m.numel() and v.dim() > 0)

    # ---- consolidated state ------------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self) -> dict:
        """What the reference optimizer's ``state_dict()`` would be (a collective: all ranks call it)."""
        engine = self.engine
        keys: list[str] = []
        step = torch.zeros((), dtype=torch.float64)
        for _, _, _, m in self._entries:
            st = self.inner.state.get(m, {})
            for k, v in st.items():
                if k not in keys and isinstance(v, torch.Tensor) and v.dim() > 0:
                    keys.append(k)
                if k == "step":
                    step = torch.maximum(step, torch.as_tensor(v, dtype=torch.float64).cpu())
        device = engine.units[0].shard.device  # the collective's device (a GPU with NCCL)
        flags = torch.tensor([float(step), 1.0 if keys else 0.0], dtype=torch.float64, device=device)
        if engine.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=engine.group)
        step, has_state = flags[0].cpu(), flags[1].cpu()
        state: dict[int, dict] = {}
        if has_state.item() > 0:
            for u in engine.units:
                with engine.masters.resident(u, self.inner.state):
                    for key in ("exp_avg", "exp_avg_sq"):
                        values = {pc.param_index: self.inner.state[m][key] for _, uu, pc, m in self._entries
                                  if uu is u and m in self.inner.state}
                        full = gather_flat(engine, u, values).cpu()
                        for p, off, n in zip(u.params, u.offsets, u.numels, strict=True):
                            st = state.setdefault(self._ref_index[id(p)], {"step": torch.tensor(float(step))})
                            st[key] = full[off:off + n].view(p.shape).clone()
        groups = []
        for gi, g in enumerate(self.inner.param_groups):
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [self._ref_index[id(p)] for p in self.reference_groups[gi]]})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a reference-format state dict, keeping only this rank's slices."""
        for g, saved in zip(self.inner.param_groups, state_dict["param_groups"], strict=True):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        for u in self.engine.units:  # with disk offload, each unit's state goes straight to its files
            with self.engine.masters.resident(u, self.inner.state, write=True):
                for ref_i, uu, pc, m in self._entries:
                    if uu is not u or ref_i not in saved_state:
                        continue
                    new = {}
                    saved = saved_state[ref_i]
                    for k in saved:
                        v = _piece_of(saved, k, pc.start, pc.stop)
                        if isinstance(v, torch.Tensor) and v.dim() > 0:
                            v = v.to(m.device, torch.float32)
                        elif isinstance(v, torch.Tensor):
                            v = v.clone().cpu() if m.device.type == "cpu" else v.clone()
                        new[k] = v
                    self.inner.state[m] = new


def _piece_of(saved, key: str, start: int, stop: int):
    """Elements ``[start, stop)`` of the flattened per-parameter state ``saved[key]`` (scalars whole).
    A checkpoint reader's lazy state (``read_slice``) reads only those elements from its files."""
    if hasattr(saved, "read_slice") and saved.ndim(key) > 0:
        return saved.read_slice(key, start, stop)
    v = saved[key]
    return v.reshape(-1)[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
