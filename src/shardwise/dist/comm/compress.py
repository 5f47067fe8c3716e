"""The data-parallel gradient all-reduce: a chosen algorithm, optionally with compression.

:class:`GradientAllReduce` is an ``all_reduce_fn(flat, group)`` for
:class:`shardwise.parallel.data.DataParallel`: it sums a bucket of (pre-averaged)
gradients in place with the configured algorithm ("auto" asks the calibrated cost model
per bucket size), and compresses what travels when asked:

* ``"fp16"`` / ``"bf16"``: cast, all-reduce in half precision, cast back.
* ``"int8"``: per-chunk absmax quantization (one fp32 scale per ``int8_chunk`` values) in the
  two-phase compressed all-reduce of 1-bit Adam (Tang et al. 2021, "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML, §4.1):
  an all-to-all of quantized blocks, each rank sums its block, re-quantizes it and an
  all-gather returns it -- with error feedback both on the workers (what quantization
  dropped from the gradient) and on the block owner (what re-quantization dropped).
* ``"topk"``: each rank keeps its ``topk_ratio`` largest-magnitude entries and exchanges
  (index, value) pairs with an all-gather; the rest is carried to the next step (error
  feedback: Lin et al. 2018, "Deep Gradient Compression", ICLR, §3; Stich et al. 2018,
  "Sparsified SGD with Memory", NeurIPS).

Every rank ends with bit-identical gradients (all dequantize the same bytes and add in rank
order). Every collective it runs is recorded in ``stats`` (:mod:`.counting`): the bytes handed to
it and, for our point-to-point algorithms, the bytes this rank put on the wire; the trainer hands
in its ledger's "dp" counter and logs them per step.

Limitation: DataParallel's per-parameter "has a gradient" flags travel in the bucket too,
so with compression they are reduced approximately (their nonzero-ness, which is all that
is used, survives: flags are 1 while gradients are small, so top-k and int8 keep them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .allreduce import all_reduce
from .collectives import all_gather, all_to_all
from .cost import CostModel, calibrate
from .counting import CommStats, nbytes

COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk")
"""Gradient compression methods."""

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def quantize_int8(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (length a multiple of ``chunk``) -> int8 values and one fp32 absmax scale per chunk."""
    blocks = x.float().reshape(-1, chunk)
    scale = blocks.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    return (q.float().reshape(-1, chunk) * scale[:, None]).reshape(q.shape)


class GradientAllReduce:
    """``fn(flat, group) -> None``: sum ``flat`` over ``group`` in place (see the module docstring).

    Args:
        algorithm: "native", "auto" or an all-reduce algorithm of :mod:`.allreduce`; for
            int8 / top-k it picks the backend's (native) or our (pairwise / ring) all-to-all
            and all-gather.
        compression: one of :data:`COMPRESSIONS`.
        topk_ratio: fraction of entries top-k sends.
        node_size: ranks per node for "hierarchical" / row length for "torus".
        int8_chunk: values per int8 scale.
        timeout_s: bound on every wait of the collectives it runs (a peer that never arrives is a
            ``TimeoutError`` naming the collective); None: the process group's timeout.
        stats: where its collectives are counted (default: a counter of its own).
        local_world_size: the launcher's ranks per node (torchrun's LOCAL_WORLD_SIZE), from which
            "auto" knows which ranks share a node (None: from the host names); a group spanning nodes
            is calibrated on both link levels, and hierarchical / torus then run with its node size
            unless ``node_size`` is given.
    """

    def __init__(self, algorithm: str = "native", compression: str = "none", topk_ratio: float = 0.01,
                 node_size: int | None = None, int8_chunk: int = 256, timeout_s: float | None = None,
                 stats: CommStats | None = None, local_world_size: int | None = None):
        if compression not in COMPRESSIONS:
            raise ValueError(f"comm.compression={compression!r} is not valid; use one of {', '.join(COMPRESSIONS)}")
        if not 0 < topk_ratio <= 1:
            raise ValueError(f"comm.topk_ratio={topk_ratio} must be in (0, 1]")
        self.algorithm, self.compression = algorithm, compression
        self.topk_ratio, self.node_size, self.int8_chunk = topk_ratio, node_size or None, int8_chunk
        self.timeout_s, self.local_world_size = timeout_s, local_world_size
        self.stats = stats if stats is not None else CommStats()
        self._models: dict[int, CostModel] = {}
        self._residual: dict[tuple, torch.Tensor] = {}
        self._verified: set[tuple] = set()
        self.choices: dict[int, str] = {}
        """With "auto": the algorithm chosen for each bucket size (bytes)."""
        self._native: set[tuple] = set()
        """``(id(group), numel, dtype)`` of the vectors already resolved to the backend's all-reduce, uncompressed."""

    @property
    def asynchronous(self) -> bool:
        """True when every call returns the backend's asynchronous handle at once (the native
        algorithm without compression): a caller needs no thread of its own to overlap it."""
        return self.algorithm == "native" and self.compression == "none"

    def pop_stats(self) -> CommStats:
        """What was handed to collectives and sent since the previous call (see :mod:`.counting`;
        the backend's own collectives' wire traffic is not visible, only what they were handed)."""
        return self.stats.pop()

    def _resolve(self, size: int, group, device: torch.device) -> tuple[str, int | None]:
        """The algorithm for a bucket of ``size`` bytes, and the node size it runs with."""
        if self.algorithm != "auto":
            return self.algorithm, self.node_size
        key = id(group)
        if key not in self._models:  # collective: every rank reaches its first bucket in the same order
            self._models[key] = calibrate(group, large=min(max(4 << 20, size), 64 << 20), device=device,
                                          local_world_size=self.local_world_size)
        model = self._models[key]
        node_size = self.node_size or model.node_size
        if size not in self.choices:  # once per bucket size: timing every algorithm's schedule costs ~1 ms
            self.choices[size] = model.choose("all_reduce", size, node_size=node_size)
        return self.choices[size], node_size

    def _first(self, *key) -> bool:
        """True the first time ``key`` is seen: check the ranks' tensors agree on the first call per
        shape only (a bucket's size never changes), not on every step."""
        if key in self._verified:
            return False
        self._verified.add(key)
        return True

    def __call__(self, flat: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work | None:
        key = (id(group), flat.numel(), flat.dtype)
        if key in self._native:  # resolved to the backend's own before: the shortest path, a few microseconds
            self.stats.hand(flat.numel() * flat.element_size(), backend=True)
            return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return self._call(flat, group, key)

    @torch.no_grad()
    def _call(self, flat: torch.Tensor, group: dist.ProcessGroup | None, key: tuple) -> dist.Work | None:
        n = dist.get_world_size(group)
        if n == 1:
            return None
        if self.compression in ("none", "fp16", "bf16"):
            wire = flat if self.compression == "none" else flat.to(_HALF[self.compression])
            alg, node_size = self._resolve(nbytes(wire), group, flat.device)
            if alg == "native" and wire is flat:  # the backend's own, asynchronous: overlaps the rest of backward
                self._native.add(key)
                self.stats.hand(nbytes(flat), backend=True)
                return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
            all_reduce(wire, "sum", group, alg, node_size=node_size, stats=self.stats,
                       timeout_s=self.timeout_s,
                       verify=self._first("all_reduce", id(group), wire.numel(), wire.dtype, alg))
            if wire is not flat:
                flat.copy_(wire)
            return None
        native = self.algorithm == "native"
        key = (flat.data_ptr(), flat.numel(), flat.dtype)
        if self.compression == "topk":
            self._topk(flat, group, n, native, key)
        else:
            self._int8(flat, group, n, native, key)
        return None

    def _gather(self, out: torch.Tensor, inp: torch.Tensor, group, n: int, native: bool) -> None:
        all_gather(out, inp, group, "native" if native else "ring", stats=self.stats,
                   timeout_s=self.timeout_s,
                   verify=self._first("all_gather", id(group), inp.numel(), inp.dtype))

    def _topk(self, flat: torch.Tensor, group, n: int, native: bool, key: tuple) -> None:
        residual = self._residual.setdefault(key, torch.zeros(flat.numel(), dtype=torch.float32,
                                                                          device=flat.device))
        v = residual.add_(flat.float())  # the gradient plus what earlier steps left behind
        k = max(1, min(flat.numel(), math.ceil(flat.numel() * self.topk_ratio)))
        idx = v.abs().topk(k, sorted=False).indices.to(torch.int32)
        vals = v[idx]
        v[idx] = 0  # sent now; the rest stays in the residual
        packet = torch.cat([idx.view(torch.uint8), vals.view(torch.uint8)])
        everyone = torch.empty(n * packet.numel(), dtype=torch.uint8, device=flat.device)
        self._gather(everyone, packet, group, n, native)
        flat.zero_()
        for row in everyone.view(n, -1):  # in rank order: identical on every rank
            flat.index_add_(0, row[:4 * k].view(torch.int32).long(), row[4 * k:].view(torch.float32).to(flat.dtype))

    def _int8(self, flat: torch.Tensor, group, n: int, native: bool, key: tuple) -> None:
        c = self.int8_chunk
        numel = flat.numel()
        B = math.ceil(math.ceil(numel / n) / c) * c  # each rank's block, a whole number of chunks
        worker = self._residual.setdefault(key, torch.zeros(n * B, device=flat.device))
        server = self._residual.setdefault((*key, "server"), torch.zeros(B, device=flat.device))
        worker[:numel].add_(flat.float())
        q, scale = quantize_int8(worker, c)
        worker.sub_(dequantize_int8(q, scale, c))  # worker error feedback
        packets = self._pack(q.view(n, B), scale.view(n, -1))
        received = torch.empty_like(packets)
        all_to_all(received, packets, group, "native" if native else "pairwise", stats=self.stats,
                   timeout_s=self.timeout_s,
                   verify=self._first("all_to_all", id(group), packets.numel(), packets.dtype))
        block = server  # my block: the sum of every rank's dequantized piece, in rank order, plus my error
        total = torch.zeros(B, device=flat.device)
        for row in received:
            total.add_(self._unpack(row, B))
        block.add_(total)
        q2, s2 = quantize_int8(block, c)
        block.sub_(dequantize_int8(q2, s2, c))  # server error feedback
        mine = self._pack(q2.view(1, B), s2.view(1, -1))[0]
        everyone = torch.empty(n * mine.numel(), dtype=torch.uint8, device=flat.device)
        self._gather(everyone, mine, group, n, native)
        result = torch.cat([self._unpack(row, B) for row in everyone.view(n, -1)])
        flat.copy_(result[:numel])

    @staticmethod
    def _pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)

    def _unpack(self, row: torch.Tensor, B: int) -> torch.Tensor:
        q = row[:B].view(torch.int8)
        scale = row[B:].view(torch.float32)
        return dequantize_int8(q, scale, self.int8_chunk)


def gradient_all_reduce(comm_cfg, stats: CommStats | None = None,
                        local_world_size: int | None = None) -> GradientAllReduce:
    """The all-reduce a :class:`shardwise.config.CommConfig` asks for, counted in ``stats``;
    ``local_world_size``: the launcher's ranks per node (see :class:`GradientAllReduce`)."""
    return GradientAllReduce(comm_cfg.algorithm, comm_cfg.compression, comm_cfg.topk_ratio,
                             comm_cfg.node_size or None, timeout_s=comm_cfg.timeout_s or None, stats=stats,
                             local_world_size=local_world_size)
