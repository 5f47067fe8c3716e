"""The world of processes, and its division into named parallel axes.

``init_distributed`` starts (or finds) the default process group of one worker.
``ParallelDims`` names the size of every axis of a layout and checks that they multiply
to the world size; ``ParallelDims.build`` turns it into a ``Mesh``, which holds this
rank's process group, rank and size along every axis. The mesh is created once and
passed to whatever needs it; nothing here is global state.

Rank layout follows Megatron-LM (Shoeybi et al. 2019, "Megatron-LM", §3; Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", §3): the
global rank is ``((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i`` -- tensor parallel is
the fastest-varying axis (neighbouring ranks, usually one node, share the most
traffic), pipeline the slowest. Expert-parallel groups are consecutive runs of ``ep``
ranks along the flattened (dp, cp) axis (cp faster), as in Megatron-Core's expert
layout, so experts are sharded over ranks that hold the same tensor/pipeline shard.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.dist.devices import process_group_backend

AXES = ("pp", "dp", "cp", "tp")
"""The axes of the device grid, slowest-varying first."""

ALL_AXES = (*AXES, "ep", "edp")
"""Every axis a ``Mesh`` answers for; ``ep`` subdivides ``dp * cp``; ``edp`` (expert data parallel) is the
complement of ``ep`` in ``dp * cp``: the ranks at the same position of their ep groups, which hold the same
experts (their gradients are reduced over it)."""

JOINT_AXES = ("dp_cp",)
"""Joint groups: ``dp_cp`` holds the ranks that differ only in (dp, cp) -- the ranks that hold the same
weights and see different tokens, over which gradients and the loss are averaged (cp faster)."""


# ---- the default process group ---------------------------------------------------------


def resolve_backend(backend: str = "auto") -> str:
    """"auto" -> "nccl" when CUDA is available, else "gloo"; other names pass through."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"parallel.backend={backend!r} is not valid; use one of 'auto', 'nccl', 'gloo'")
    return backend


def _device_for(backend: str, local_rank: int, device: str = "auto") -> torch.device:
    """nccl, or ``device="cuda"`` (gloo with CUDA tensors): ``cuda:local_rank`` (modulo the GPUs there
    are, so two gloo ranks can share one GPU), made current; otherwise the CPU."""
    if device == "cuda" or (device == "auto" and "nccl" in backend):
        index = local_rank % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(backend: str = "auto", timeout_s: float = 600.0,
                     device: str = "auto") -> tuple[int, int, int, torch.device]:
    """Initialise this worker's default process group; return ``(rank, world_size, local_rank, device)``.

    * Already initialised (e.g. by a test harness): return what exists.
    * torchrun-style environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
      ``MASTER_PORT``): join that world.
    * Neither (a plain ``python`` process): a one-rank group on an in-memory ``HashStore``.

    The store is created explicitly and namespaced per restart attempt with
    ``PrefixStore(f"restart{TORCHELASTIC_RESTART_COUNT}", store)``: after torchrun
    ``--max-restarts`` restarts the workers, the agent's store still holds the keys of
    the previous attempt and a gloo group rendezvousing on them can fail to connect.
    When torchrun's agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE=True``) every
    rank is a client of it; otherwise rank 0 hosts it (as ``torch.distributed``'s own
    ``env://`` rendezvous does). ``timeout_s`` bounds rendezvous and every collective.

    ``backend="auto"`` picks nccl when CUDA is available (and makes ``cuda:local_rank``
    the current device), gloo otherwise; the returned device follows the backend. With nccl the
    group is created as ``"cpu:gloo,cuda:nccl"`` (:func:`~shardwise.dist.devices.process_group_backend`):
    CUDA tensors go over nccl, the small CPU exchanges (RNG states, metadata checks) over gloo, and
    every group made from it (``dist.new_group``, the mesh's ``DeviceMesh``) inherits both.
    ``device`` (``run.device``): "cuda" puts the tensors on the GPU whatever the backend (gloo with
    CUDA tensors, for the collectives gloo implements on CUDA), "cpu" on the CPU, "auto" follows it.
    """
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return rank, world, local_rank, _device_for(dist.get_backend(), local_rank, device)

    backend = resolve_backend(backend)
    if "RANK" not in os.environ:
        dev = _device_for(backend, 0, device)
        dist.init_process_group(process_group_backend(backend), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return 0, 1, 0, dev

    missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"RANK is set but {', '.join(missing)} is not; launch workers with torchrun")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = _device_for(backend, local_rank, device)
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=rank == 0 and not use_agent_store,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"restart{attempt}", store)
    dist.init_process_group(process_group_backend(backend), store=store, rank=rank, world_size=world,
                            timeout=timeout)
    return rank, world, local_rank, dev


# ---- axis sizes -----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_distributed() -> None:
    """Leave the default process group cleanly: a barrier, then destroy it.

    Without the barrier a gloo rank can tear down its connections while a peer is still using
    them, and the peer aborts in native code ("terminate called without an active exception")
    at exit: seen about one run in four under torchrun on 2 cores, none in 12 with it."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass
class ParallelDims:
    """Sizes of the parallel axes of one layout.

    ``pp * dp * cp * tp == world_size``; ``ep`` (expert parallel) does not add ranks, it
    shards experts over a subdivision of the ``dp * cp`` ranks, so it must divide
    ``dp * cp``. ``world_size=None`` means "the product of the axes".
    """

    pp: int = 1
    """Pipeline-parallel stages (slowest-varying axis)."""
    dp: int = 1
    """Data-parallel replicas."""
    cp: int = 1
    """Context-parallel shards of the sequence."""
    tp: int = 1
    """Tensor-parallel shards (fastest-varying axis)."""
    ep: int = 1
    """Expert-parallel shards, carved out of dp * cp."""
    world_size: int | None = None
    """Number of processes; default pp * dp * cp * tp."""

    def __post_init__(self) -> None:
        if self.world_size is None and all(isinstance(getattr(self, a), int) for a in AXES):
            self.world_size = self.pp * self.dp * self.cp * self.tp

    @classmethod
    def from_config(cls, parallel_cfg, world_size: int) -> ParallelDims:
        """From a ``ParallelConfig``; an unset ``dp`` becomes ``world_size / (tp * pp * cp)``."""
        p = parallel_cfg
        dp = p.dp
        if dp is None:
            dp = max(world_size // max(p.tp * p.pp * p.cp, 1), 1)
        dims = cls(pp=p.pp, dp=dp, cp=p.cp, tp=p.tp, ep=p.ep, world_size=world_size)
        dims.validate()
        return dims

    def validate(self) -> ParallelDims:
        """Raise ``ValueError`` naming the offending field unless the sizes form a layout."""
        for axis in (*AXES, "ep", "world_size"):
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                name = "world size" if axis == "world_size" else f"parallel.{axis}"
                raise ValueError(f"{name}={value!r} must be a positive integer")
        product = self.dp * self.tp * self.pp * self.cp
        if product != self.world_size:
            hint = ""
            mp = self.tp * self.pp * self.cp
            if self.world_size % mp == 0:
                hint = f"; set parallel.dp={self.world_size // mp}"
            raise ValueError(f"parallel.dp*tp*pp*cp={product} does not match the world size {self.world_size}{hint}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} does not divide parallel.dp*cp={self.dp * self.cp}; "
                f"use one of {_divisors(self.dp * self.cp)}"
            )
        return self

    def size(self, axis: str) -> int:
        _check_axis(axis)
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis == "edp":
            return self.dp * self.cp // self.ep
        return getattr(self, axis)

    def rank_grid(self) -> torch.Tensor:
        """Global ranks laid out as a (pp, dp, cp, tp) grid (tp fastest)."""
        return torch.arange(self.world_size).reshape(self.pp, self.dp, self.cp, self.tp)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of global ranks along ``axis``, each group in axis order.

        Pure arithmetic (no communication): the ranks that differ only in their
        coordinate on ``axis``. For ``ep``: consecutive runs of ``ep`` ranks of the
        flattened (dp, cp) axis, at fixed (pp, tp).
        """
        _check_axis(axis)
        self.validate()
        grid = self.rank_grid()
        if axis in ("ep", "edp"):
            grid = grid.reshape(self.pp, self.dp * self.cp // self.ep, self.ep, self.tp)
            if axis == "edp":
                return grid.permute(0, 3, 2, 1).reshape(-1, self.dp * self.cp // self.ep).tolist()
            return grid.permute(0, 1, 3, 2).reshape(-1, self.ep).tolist()
        if axis == "dp_cp":
            return grid.permute(0, 3, 1, 2).reshape(-1, self.dp * self.cp).tolist()
        d = AXES.index(axis)
        return grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()

    def coords(self, global_rank: int) -> dict[str, int]:
        """This rank's coordinate along every axis (``ep``: position inside its ep group)."""
        out = {}
        for axis in ALL_AXES:
            for g in self.groups(axis):
                if global_rank in g:
                    out[axis] = g.index(global_rank)
        return out

    def build(self, device_type: str = "cpu", timeout_s: float | None = None) -> Mesh:
        """Create the process groups of every axis; collective over the default group.

        Every rank must call it, in the same order relative to other group creations. Every group
        waits at most ``timeout_s`` in a collective (default: the default group's timeout, i.e.
        ``parallel.timeout_s``): torch's own default for a new group is 30 minutes, so a hung peer
        inside a tp, cp, pp, ep or dp group would otherwise hang its partners that long. The axis
        groups are made with ``dist.new_group`` (an axis spanning the world is the default group)
        and handed to torch's ``DeviceMesh`` (kept as ``Mesh.device_mesh`` for DTensor-based peers).
        """
        from torch.distributed.device_mesh import DeviceMesh

        self.validate()
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build needs an initialised default process group; call init_distributed()")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"parallel.dp*tp*pp*cp={self.world_size} does not match the world size {dist.get_world_size()}"
            )
        timeout = default_group_timeout() if timeout_s is None else timedelta(seconds=timeout_s)
        me = dist.get_rank()
        mine = {axis: next(g for g in self.groups(axis) if me in g) for axis in (*ALL_AXES, *JOINT_AXES)}
        groups: dict = {}
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}

        def group_of(axis: str) -> dist.ProcessGroup:
            """This rank's group along ``axis``; every rank creates every group of it, in the same order."""
            for ranks in self.groups(axis):
                key = tuple(ranks)
                if key not in made:
                    made[key] = dist.group.WORLD if len(ranks) == self.world_size and timeout_s is None \
                        else dist.new_group(ranks, timeout=timeout)
            return made[tuple(mine[axis])]

        for axis in (*AXES, "ep", "edp", *JOINT_AXES):  # the same ranks give the same group (no new one)
            groups[axis] = group_of(axis)
        grid = self.rank_grid()
        device_mesh = DeviceMesh.from_group([groups[a] for a in AXES], device_type, mesh=grid, mesh_dim_names=AXES)
        for axis in (*ALL_AXES, *JOINT_AXES):  # the groups must agree with our layout arithmetic
            got = dist.get_process_group_ranks(groups[axis])
            if got != mine[axis]:
                raise RuntimeError(f"mesh axis {axis}: the group holds ranks {got}, expected {mine[axis]}")
        return Mesh(dims=self, global_rank=me, device_mesh=device_mesh, _groups=groups, _ranks=mine)


def default_group_timeout() -> timedelta:
    """How long the default process group's collectives wait (what ``init_process_group`` was given)."""
    group = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return dist.distributed_c10d.default_pg_timeout


def _check_axis(axis: str) -> None:
    if axis not in ALL_AXES and axis not in JOINT_AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; use one of {', '.join((*ALL_AXES, *JOINT_AXES))}")


# ---- the built mesh ---------------------------------------------------------------------------


@dataclass(eq=False)
class Mesh:
    """This rank's view of a layout: a process group, rank and size per axis.

    ``group(axis)`` is the group of ranks that differ from this one only along
    ``axis``; ``rank(axis)`` is this rank's index in it. ``dp_group``/``dp_rank``/
    ``dp_size`` are shorthands for the data-parallel axis.
    """

    dims: ParallelDims
    global_rank: int
    device_mesh: object = None
    _groups: dict = field(default_factory=dict, repr=False)
    _ranks: dict = field(default_factory=dict, repr=False)

    def group(self, axis: str) -> dist.ProcessGroup:
        _check_axis(axis)
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        _check_axis(axis)
        return self._ranks[axis]

    def rank(self, axis: str) -> int:
        return self.ranks(axis).index(self.global_rank)

    def size(self, axis: str) -> int:
        return self.dims.size(axis)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def subgroup(self, axis: str, size: int) -> dist.ProcessGroup:
        """This rank's group of ``size`` consecutive ranks of its ``axis`` group (e.g. ZeRO++ hpZ's node groups
        inside the data-parallel group). A collective over the default group: every rank creates every such
        group, in the same order."""
        if self.size(axis) % size:
            raise ValueError(f"a subgroup of {size} ranks does not divide the {axis} group of {self.size(axis)}")
        mine = None
        for ranks in self.dims.groups(axis):
            for first in range(0, len(ranks), size):
                sub = ranks[first:first + size]
                group = dist.new_group(sub)
                if self.global_rank in sub:
                    mine = group
        return mine

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")
