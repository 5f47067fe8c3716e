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

Traffic is *measured where it is sent*: every message of a parameter gather that goes through our
direct exchange (:mod:`.exchange`, gloo with CPU tensors) reports its bytes and its destination, and the
bytes are added up by phase and by whether the destination is on this rank's node (ranks of the
data-parallel group in consecutive runs of ``node_size``). Gathers the backend runs itself (NCCL's, and
the int8 gathers of qwZ) move their bytes where no Python code sees them: they are reported apart, as
``backend_gather_bytes`` (what they were handed), never split by a formula.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.dist.mesh import default_group_timeout
from shardwise.parallel.zero import exchange
from shardwise.parallel.zero.flat import FlatUnit

TRAFFIC_KEYS = ("forward_intra_node", "forward_inter_node", "backward_intra_node", "backward_inter_node",
                "backend_gather_bytes")


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
        group_ranks: the global ranks of the data-parallel group, in order (default: the world's), whose
            consecutive runs of ``node_size`` are the nodes.
    """

    def __init__(self, node_group: dist.ProcessGroup | None, node_size: int, world: int,
                 group_ranks: list[int] | None = None):
        self.group = node_group
        self.size = node_size
        self.world = world
        self.local_rank = dist.get_rank(node_group) if node_group is not None else 0
        ranks = list(range(world)) if group_ranks is None else group_ranks
        self._node_of = {g: i // node_size for i, g in enumerate(ranks)}
        self._my_node = self._node_of.get(dist.get_rank(), -1)
        self.traffic = dict.fromkeys(TRAFFIC_KEYS, 0)
        """Bytes this rank sent in parameter gathers since the last ``pop_traffic`` (measured at each
        send), and the bytes handed to gathers the backend runs (not visible)."""
        self.held_bytes = 0
        """Bytes of the secondary partitions' storages alive now."""
        self.peak_bytes = 0
        """The most ``held_bytes`` has been (measured at each allocation)."""

    def counter(self, phase: str):
        """``on_send_to`` for :func:`.exchange.all_gather`: adds each message to ``phase``'s traffic, intra- or
        inter-node by its destination."""
        def sent(nbytes: int, dst: int) -> None:
            where = "intra" if self._node_of.get(dst, -2) == self._my_node else "inter"
            self.traffic[f"{phase}_{where}_node"] += nbytes
        return sent

    def unmeasured(self, nbytes: int) -> None:
        """A gather run by the backend: its wire bytes are not visible, only what it was handed."""
        self.traffic["backend_gather_bytes"] += nbytes

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

    def gather(self, unit: FlatUnit, direct: bool, on_send=None):
        """Launch the intra-node all-gather of the secondary partitions into ``unit.full``: our direct exchange
        (``direct``: gloo, CPU tensors; every message counted, ``on_send`` too) or the backend's."""
        if direct:
            return exchange.all_gather(unit.full, self.group, unit.secondary, tag=exchange.TAG + 2 * unit.index + 1,
                                       on_send=on_send, on_send_to=self.counter("backward"))
        self.unmeasured(unit.param_bytes_full())
        return dist.all_gather_single(unit.full, unit.secondary, group=self.group, async_op=True)

    def drop(self, unit: FlatUnit) -> None:
        secondary = getattr(unit, "secondary", None)
        if isinstance(secondary, torch.Tensor):
            self.held_bytes -= secondary.untyped_storage().nbytes()
        unit.secondary = None

    def nbytes(self, units: list[FlatUnit]) -> int:
        """Capacity of the secondary partitions (every unit but the root, which stays gathered, and the
        expert units, sliced over their own replicas: they gather from their primary slices in backward too)."""
        if not self.enabled:
            return 0
        group = units[0].group
        return sum(self.secondary_numel(u) * u.full.element_size() for u in units[1:] if u.group is group)

    def pop_traffic(self) -> dict[str, int]:
        out, self.traffic = self.traffic, dict.fromkeys(TRAFFIC_KEYS, 0)
        return out


def secondary_bytes_held(units: list[FlatUnit]) -> int:
    """Bytes of secondary partitions alive right now (for tests of when they are freed)."""
    return sum(u.secondary.numel() * u.secondary.element_size() for u in units
               if getattr(u, "secondary", None) is not None and isinstance(u.secondary, torch.Tensor))
