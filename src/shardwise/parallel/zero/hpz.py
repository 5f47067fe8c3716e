"""Hierarchical partitioning of ZeRO-3 parameters (ZeRO++ hpZ).

Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv:2306.10209), §3.2: after a unit's *forward* all-gather over all N data-parallel
ranks, each rank keeps a **secondary partition** of the gathered parameters, sharded only over
the ``h`` ranks of its node (subgroups of ``h`` consecutive data-parallel ranks). The *backward*
all-gather then runs inside the node, from the secondary partitions, so no parameter bytes cross
a node boundary in backward. The price is memory: each rank holds ``padded_numel / h`` extra
elements per unit from its forward until its backward gather (the paper's "M/h" term).

The secondary copy holds exactly the values the forward gather produced (the dequantized values
under int8 gathers, qwZ), so a run with hpZ computes bit for bit what it computes without.

Traffic is reported as the bytes a rank *receives* in parameter gathers, split by whether the
sender is on the same node: a gather of ``P`` bytes over the global group brings
``P·(h-1)/N`` from the node and ``P·(N-h)/N`` from other nodes; over the node group,
``P·(h-1)/h`` and nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.dist.mesh import default_group_timeout
from shardwise.parallel.zero.flat import FlatUnit

TRAFFIC_KEYS = ("forward_intra_node", "forward_inter_node", "backward_intra_node", "backward_inter_node")


def node_groups(group: dist.ProcessGroup | None, node_size: int) -> dist.ProcessGroup:
    """This rank's subgroup of ``node_size`` consecutive ranks of ``group``.

    A collective over the *whole world* (``dist.new_group`` must be called by every process in
    the same order), so it works only when ``group`` spans the world; a data-parallel group that
    is a strict subset (with tensor or pipeline parallelism) must be given its node subgroup by
    the caller, who sees every data-parallel group at once.
    """
    world = dist.get_world_size(group)
    if world % node_size:
        raise ValueError(f"hpz_size={node_size} must divide the data-parallel size {world}")
    if world != dist.get_world_size():
        raise ValueError("hpz_size > 1 on a data-parallel group smaller than the world needs hpz_group")
    mine = None
    for first in range(0, world, node_size):
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(first, first + node_size)]
        g = dist.new_group(ranks, timeout=default_group_timeout())  # bounded as parallel.timeout_s
        if dist.get_rank(group) // node_size == first // node_size:
            mine = g
    return mine


class NodePartition:
    """The secondary (intra-node) partitions of the units of one rank, and the gather traffic.

    Args:
        node_group: this rank's node subgroup (``None`` with ``node_size == 1``: hpZ off, only
            the traffic split is reported, against nodes of ``report_node_size`` ranks).
        node_size: ranks per node subgroup, ``h``.
        world: the data-parallel size N.
    """

    def __init__(self, node_group: dist.ProcessGroup | None, node_size: int, world: int):
        self.group = node_group
        self.size = node_size
        self.world = world
        self.local_rank = dist.get_rank(node_group) if node_group is not None else 0
        self.traffic = dict.fromkeys(TRAFFIC_KEYS, 0)
        """Bytes received by this rank in parameter gathers since the last ``pop_traffic``."""
        self.held_bytes = 0
        """Bytes of the secondary partitions' storages alive now."""
        self.peak_bytes = 0
        """The most ``held_bytes`` has been (measured at each allocation)."""

    @property
    def enabled(self) -> bool:
        return self.group is not None and self.size > 1

    def secondary_numel(self, unit: FlatUnit) -> int:
        return unit.padded_numel // self.size

    def keep(self, unit: FlatUnit) -> None:
        """Copy this rank's node slice of the freshly gathered ``unit.full`` (the secondary partition)."""
        n = self.secondary_numel(unit)
        self.drop(unit)
        unit.secondary = unit.full[self.local_rank * n:(self.local_rank + 1) * n].clone()
        self.held_bytes += unit.secondary.untyped_storage().nbytes()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def gather(self, unit: FlatUnit) -> dist.Work:
        """Launch the intra-node all-gather of the secondary partitions into ``unit.full``."""
        self.count(unit, phase="backward", within_node=True)
        return dist.all_gather_single(unit.full, unit.secondary, group=self.group, async_op=True)

    def count(self, unit: FlatUnit, phase: str, within_node: bool, nbytes: int | None = None) -> None:
        """Add one gather of ``unit`` (``nbytes`` on the wire, default the full buffer) to the traffic."""
        total = unit.param_bytes_full() if nbytes is None else nbytes
        if within_node:
            self.traffic[f"{phase}_intra_node"] += total * (self.size - 1) // self.size
            return
        self.traffic[f"{phase}_intra_node"] += total * (self.size - 1) // self.world
        self.traffic[f"{phase}_inter_node"] += total * (self.world - self.size) // self.world

    def drop(self, unit: FlatUnit) -> None:
        secondary = getattr(unit, "secondary", None)
        if isinstance(secondary, torch.Tensor):
            self.held_bytes -= secondary.untyped_storage().nbytes()
        unit.secondary = None

    def nbytes(self, units: list[FlatUnit]) -> int:
        """Capacity of the secondary partitions (every unit but the root, which stays gathered)."""
        if not self.enabled:
            return 0
        return sum(self.secondary_numel(u) * u.full.element_size() for u in units[1:])

    def pop_traffic(self) -> dict[str, int]:
        out, self.traffic = self.traffic, dict.fromkeys(TRAFFIC_KEYS, 0)
        return out


def secondary_bytes_held(units: list[FlatUnit]) -> int:
    """Bytes of secondary partitions alive right now (for tests of when they are freed)."""
    return sum(u.secondary.numel() * u.secondary.element_size() for u in units
               if getattr(u, "secondary", None) is not None and isinstance(u.secondary, torch.Tensor))
