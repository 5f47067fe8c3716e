"""ZeRO's flat units as the planner assumes them: model-state bytes per rank, padding included.

Rajbhandari et al. 2020, "ZeRO" (SC'20), §5 divides Ψ parameters evenly over N_d ranks. An engine that
keeps each *unit* of parameters in one flat buffer (DeepSpeed's flat partitions, FSDP's FlatParameter)
pads the buffer to a multiple of N, so rank r owns the r-th of N equal slices: per unit u, ⌈n_u/N⌉
elements per rank instead of n_u/N. The planner assumes these units (the rules are stated here; the
trainer's are its own code, and ``tests/test_plan_measured.py`` holds the two against each other):

* ZeRO-1/2: the model's trainable tensors (:func:`shardwise.plan.tensors.model_params`, a tied one once)
  grouped as DDP groups them into buckets (Li et al. 2020, "PyTorch Distributed", §3.2.3): in *reverse*
  registration order, a bucket closed as soon as it holds at least ``parallel.bucket_mb`` MiB of fp32
  parameters (a larger tensor gets a bucket of its own).
* ZeRO-3: FSDP's wrapping of a transformer (Zhao et al. 2023, "PyTorch FSDP", §3.2.1: one unit per
  ``parallel.zero_unit`` transformer blocks), plus a root unit holding every other parameter
  (embeddings, final norm, untied head).
* inside a pipeline, the same over what pipeline rank 0 holds (:func:`first_rank_params`: its stages'
  embedding side and blocks, registered in that order); ZeRO-3's units restart at each of its chunks.

With ZeRO++ hierarchical partitioning (hpZ, ``parallel.zero_hpz = h``; Wang et al. 2023, "ZeRO++",
§3.2) a ZeRO-3 rank also keeps, from each unit's forward gather to its backward gather, a *secondary
partition* of that unit sharded over the h ranks of its node: ``padded_numel // h`` elements per unit,
for every unit but the root (which stays gathered from forward to backward): the paper's "M/h".

What a rank holds: parameters -- the padded full buffers (stages 1, 2) or the padded slices (stage 3);
gradients -- the padded full buffers (stage 1) or the padded slices (stages 2, 3); optimizer states and
separate master weights -- one entry per *real* element of the rank's slices (padding has none), so
rank 0, whose slices are all real, is the busiest, and its bytes are the paper's formula with Ψ replaced
by the padded Σ_u ⌈n_u/N⌉·N.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.plan.spec import ModelSpec
from shardwise.plan.tensors import ParamEntry
from shardwise.plan.tensors import model_params as shape_params

MODULE_PARAM_BYTES = 4
"""The module holds fp32 parameters (mixed precision makes the low-precision copies, Micikevicius et
al. 2018); the bucket cap counts their bytes."""


def model_params(spec: ModelSpec) -> list[ParamEntry]:
    """The model's trainable tensors from its shape (:func:`shardwise.plan.tensors.model_params`)."""
    return shape_params(spec)


def bucket_numels(numels: list[int], bucket_mb: float, elem_bytes: int = MODULE_PARAM_BYTES) -> list[list[int]]:
    """ZeRO-1/2 units: ``numels`` (registration order) bucketed in reverse order, each bucket closed
    once it reaches ``bucket_mb`` MiB (DDP's rule, Li et al. 2020 §3.2.3)."""
    cap = max(int(bucket_mb * 2**20), 1)
    buckets, current, size = [], [], 0
    for n in reversed(numels):
        current.append(n)
        size += n * elem_bytes
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def chunk_runs(blocks: list[int]) -> list[list[int]]:
    """The runs of consecutive block indices: a pipeline rank's chunks (its stages c·p + rank hold blocks
    that are never adjacent when p > 1), or the whole model's one run."""
    runs: list[list[int]] = []
    for b in sorted(set(blocks)):
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def stage3_numels(params: list[ParamEntry], zero_unit: int) -> list[list[int]]:
    """ZeRO-3 units: the root (every parameter outside the blocks) first, if there is any, then ``zero_unit``
    blocks each, counted from the first block of each chunk (a unit never spans two chunks)."""
    root = [p.numel for p in params if p.block is None]
    units = [root] if root else []
    for run in chunk_runs([p.block for p in params if p.block is not None]):
        for i in range(0, len(run), zero_unit):
            group = set(run[i:i + zero_unit])
            units.append([p.numel for p in params if p.block in group])
    return units


EMBEDDING_SIDE = ("tok_emb", "pos_emb", "type_emb", "emb_norm")
"""What the first pipeline stage holds besides its blocks (GPipe, Huang et al. 2019 §2.1: the embedding
starts the first cell)."""


def first_rank_params(params: list[ParamEntry], blocks: set[int]) -> list[ParamEntry]:
    """The parameters pipeline rank 0 holds (``blocks``: those of its stages c·p), in the order its stages
    register them: the embedding side first, then the blocks. Its stages are never the last (p > 1), so it
    holds no head."""
    return ([e for e in params if e.block is None and e.name.split(".")[0] in EMBEDDING_SIDE]
            + [e for e in params if e.block in blocks])


@dataclass(frozen=True)
class ZeroUnits:
    """The flat units of one ZeRO engine: real elements per unit, the stage and the group size N."""

    stage: int
    world: int
    numels: tuple[int, ...]
    root_units: int = 0
    """Leading units gathered once per micro-batch in ZeRO-3 (the root: 1, or 0 on a pipeline rank without
    one); the others twice."""
    n_tensors: int = 0
    """Parameter tensors in all units: the engine all-reduces one uint8 "had a gradient" flag per
    tensor each step (``ZeroDataParallel._agree_on_grads``)."""
    hpz: int = 1
    """ZeRO-3 hpZ secondary-partition size h (``parallel.zero_hpz``; 1 = off)."""

    @property
    def secondary_numel(self) -> int:
        """hpZ: elements of the secondary partitions a rank holds, Σ over non-root units of
        ``padded_numel // h`` (shardwise.parallel.zero.hpz ``NodePartition.secondary_numel``)."""
        if self.stage != 3 or self.hpz <= 1:
            return 0
        return sum(p // self.hpz for p in self.padded_numels[self.root_units:])

    @property
    def shard_numels(self) -> tuple[int, ...]:
        return tuple(-(-n // self.world) for n in self.numels)

    @property
    def padded_numels(self) -> tuple[int, ...]:
        return tuple(s * self.world for s in self.shard_numels)

    @property
    def psi(self) -> int:
        """Ψ: the model's parameters, unpadded (the paper's count)."""
        return sum(self.numels)

    @property
    def psi_padded(self) -> int:
        """Σ_u ⌈n_u/N⌉·N: what the flat buffers hold."""
        return sum(self.padded_numels)

    @property
    def padding(self) -> int:
        return self.psi_padded - self.psi

    def owned(self, rank: int = 0) -> int:
        """Real (non-padding) elements in ``rank``'s slices: its optimizer and master entries."""
        return sum(max(0, min(n, (rank + 1) * s) - rank * s)
                   for n, s in zip(self.numels, self.shard_numels, strict=True))

    def state_elements(self, rank: int = 0) -> dict[str, int]:
        """Elements per category on ``rank`` (multiply by each state's bytes per element); ZeRO-3's
        parameters include the hpZ secondary partitions (:attr:`secondary_numel`)."""
        shard, padded = sum(self.shard_numels), self.psi_padded
        own = self.owned(rank)
        return {"params": shard + self.secondary_numel if self.stage >= 3 else padded,
                "grads": padded if self.stage == 1 else shard,
                "master": own, "optimizer": own}


def zero_units(params: list[ParamEntry], stage: int, world: int, bucket_mb: float = 25.0,
               zero_unit: int = 1, hpz: int = 1) -> ZeroUnits:
    """The units of the rules above on ``world`` data-parallel ranks, for the tensors ``params``
    (:func:`model_params`)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {stage}; the engine has units for stages 1, 2 and 3")
    if hpz != 1 and (stage != 3 or world % hpz):
        raise ValueError(f"hpZ size {hpz} needs ZeRO-3 and must divide the data-parallel size {world}")
    if stage == 3:
        groups = stage3_numels(params, zero_unit)
    else:
        groups = bucket_numels([p.numel for p in params], bucket_mb)
    has_root = any(p.block is None for p in params)
    return ZeroUnits(stage, world, tuple(sum(g) for g in groups), root_units=1 if stage == 3 and has_root else 0,
                     n_tensors=sum(len(g) for g in groups), hpz=hpz)


def engine_state_bytes(units: ZeroUnits, b: dict[str, int], rank: int = 0,
                       separate_master: bool = False) -> dict[str, int]:
    """Bytes per category on ``rank`` (what shardwise.train.memory.model_state_bytes reports):
    ``b`` is bytes per element of params, grads, master and optimizer (``StateDtypes.bytes()``);
    ``separate_master`` when the engine keeps fp32 master pieces apart (offload or 16-bit flat
    parameters; shardwise.parallel.zero.offload.MasterStore), 4 bytes each if ``b`` has none."""
    el = units.state_elements(rank)
    master = b["master"] or (4 if separate_master else 0)
    return {"params": el["params"] * b["params"], "grads": el["grads"] * b["grads"],
            "master": el["master"] * master, "optimizer": el["optimizer"] * b["optimizer"]}
