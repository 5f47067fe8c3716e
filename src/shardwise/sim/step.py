"""One training step of every pipeline rank as tasks: the engine's schedule, buckets and units.

Ranks that behave alike are simulated once: the tensor-, context- and data-parallel peers of a pipeline
rank do the same work at the same time, so one representative per pipeline rank is simulated (global rank
``pp_rank * dp * cp * tp``, :class:`~shardwise.dist.mesh.ParallelDims`), and each of its collectives is
costed with every group of that axis in its pipeline stage communicating at once, on the whole fabric
(:mod:`shardwise.sim.network`).

What is taken from the engine rather than described again:

* the pipeline's action lists, every schedule (:func:`shardwise.parallel.pipeline.schedules.build_schedule`),
  and the blocks of every stage (:func:`shardwise.parallel.pipeline.partition.partition`, the trainer's
  ``parallel.pp_partition``); sends after each computation, each receive a dependency of the computation
  that needs it (:class:`~shardwise.parallel.pipeline.executor.Pipeline`); activations travel in fp32;
* the buckets and ZeRO units (:mod:`shardwise.sim.params`): without a pipeline a bucket's all-reduce (ZeRO-1/2:
  reduce-scatter) starts when the last micro-batch's backward has produced all its gradients, in bucket
  order (Li et al. 2020 §3.2.3), and earlier micro-batches accumulate without communication (``no_sync``);
  with a pipeline each bucket once the last backward of every chunk it holds has run (the executor's
  :func:`~shardwise.parallel.pipeline.executor.last_backward_actions`; from the tied table's bucket on, and under
  zb-h1, after the flush: Narayanan et al. 2021 §3); ZeRO-3 gathers each
  unit before its forward and again before its backward, the next unit's gather in flight during the current
  unit's compute (prefetch), the root unit once per micro-batch, and reduce-scatters each unit once its last
  backward is done (Rajbhandari et al. 2020 §5.3; Zhao et al. 2023 §3.3), where the engine's hooks issue them
  (:mod:`shardwise.sim.zero3`). Expert weights under expert parallelism are bucketed and sliced over their
  replicas (mesh axis ``edp``), the rest over dp x cp. Whether a reduce-scatter runs beside backward or is
  waited for at once is the engine's rule (:func:`shardwise.parallel.zero.reduce.overlaps_reduce`: ZeRO-1/2 as
  ``parallel.zero_overlap_grad_reduce`` says, ZeRO-3 on GPUs only); in a pipeline ZeRO-1/2 reduce each bucket once
  the last backward of every chunk it holds has run (the executor's
  :func:`~shardwise.parallel.pipeline.executor.last_backward_actions`), except from the tied table's bucket on,
  which waits for the flush; ZeRO-1/2's all-gathers of the updated weights run, with
  ``parallel.zero_overlap_param_gather``, beside the next step's forward, each piece's forward waiting for the
  buckets holding its parameters (issued at the step's start in the engine's order,
  :func:`shardwise.parallel.zero.gather.forward_order`: the steady state of the previous step's gathers);
* the step around them (:mod:`shardwise.train.loop`): ZeRO's "had a gradient" flags, the global gradient
  norm's all-reduces (tp, the shard group, pp), the optimizer, ZeRO-1/2's gathers of the updated weights (unless
  they overlap the next forward),
  the pipeline's loss all-reduce and timeline gather, the loop's loss all-reduce.
"""

from __future__ import annotations

import numpy as np

from shardwise.config import Config
from shardwise.dist.mesh import ParallelDims
from shardwise.parallel.pipeline.executor import last_backward_actions
from shardwise.parallel.pipeline.partition import config_split
from shardwise.parallel.pipeline.schedules import RECV_F, SEND_B, SEND_F, B, F, W, build_schedule
from shardwise.parallel.zero.gather import forward_order
from shardwise.parallel.zero.reduce import overlaps_reduce
from shardwise.sim.costs import RankCosts
from shardwise.sim.layers import LayerComm
from shardwise.sim.network import Fabric
from shardwise.sim.params import EMBED, HEAD, RankParams, meta_model, rank_params
from shardwise.sim.tasks import COMPUTE, Graph, Task
from shardwise.sim.zero3 import Stage3Hooks

AXIS_OF = {"dp_cp": "dp", "edp": "dp", "hpz": "dp"}
"""Gradient reductions and ZeRO's gathers over dp x cp, the expert replicas or hpZ's node subgroups are shown as
the data-parallel axis."""
ACT_BYTES = 4
"""The executor sends activations and their gradients in fp32 (``Pipeline(act_dtype=torch.float32)``)."""


class StepBuilder:
    """The task graph of one step of a resolved config on a fabric."""

    def __init__(self, cfg: Config, fabric: Fabric, costs: RankCosts, moe_imbalance: float = 1.0):
        p = cfg.parallel
        self.cfg, self.fabric, self.costs = cfg, fabric, costs
        self.dims = ParallelDims(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep)
        self.pp, self.v = p.pp, p.pp_virtual if p.pp > 1 else 1
        self.m = cfg.train.grad_accum
        self.per_stage = p.dp * p.cp * p.tp
        if p.pp > 1:
            self.split = config_split(cfg)
        else:
            self.split = [range(cfg.model.n_layers)]
        model = meta_model(cfg)
        self.params: list[RankParams] = [rank_params(cfg, model, self.stages(r), self.split) for r in range(self.pp)]
        self.graph = Graph(self.pp)
        self._comm_cache: dict[tuple, float] = {}
        self._copies: dict[int, list[Task]] = {}
        """ZeRO-Offload's gradient copies to the host, per rank: the host's optimizer step waits for them."""
        self._groups: dict[str, list[list[int]]] = {}
        self._crosses: dict[str, bool] = {}
        self.algorithms: dict[str, str] = {}
        """Which algorithm each (axis, collective) was costed with (the cheaper of ring and two-level)."""
        self.layers = LayerComm(cfg, costs, self._comm_on(0), moe_imbalance)
        self.reduce_overlaps = overlaps_reduce(p.zero, fabric.hw.backend != "gloo", p.zero_overlap_grad_reduce)
        """Whether ZeRO's reduce-scatters run beside backward (the engine's rule)."""
        self.gather_overlaps = p.zero in (1, 2) and p.zero_overlap_param_gather and p.dp * p.cp > 1
        """Whether ZeRO-1/2's weight gathers run beside the next forward."""
        self._early_reduce = (p.zero == 0 or p.zero in (1, 2) and self.reduce_overlaps) and p.dp * p.cp > 1
        """Plain data parallelism and ZeRO-1/2 in a pipeline reduce each bucket during its chunks' last backward
        (``final_backward``)."""
        self._final_tasks: dict[tuple[int, int, object], Task] = {}
        """Per (pipeline rank, chunk, piece): the piece's task in the chunk's last backward (its gradients final after
        it)."""

    def stages(self, r: int) -> list[int]:
        return [c * self.pp + r for c in range(self.v)]

    # ---- communication on the representative's groups ------------------------------------------------------

    def groups(self, axis: str, r: int) -> list[list[int]]:
        """Every group of ``axis`` among the ranks of pipeline rank ``r`` (they all communicate at once);
        ``hpz``: ZeRO++'s node subgroups, runs of ``parallel.zero_hpz`` consecutive ranks of each dp x cp group."""
        if axis == "hpz":
            h = self.cfg.parallel.zero_hpz
            return [g[i:i + h] for g in self.groups("dp_cp", r) for i in range(0, len(g), h)]
        if axis not in self._groups:
            self._groups[axis] = self.dims.groups(axis)
        lo, hi = r * self.per_stage, (r + 1) * self.per_stage
        return [g for g in self._groups[axis] if lo <= g[0] < hi]

    def comm(self, axis: str, collective: str, nbytes: float, r: int = 0, native: bool | None = None) -> float:
        """Seconds of one ``collective`` over ``axis`` (every group of pipeline rank ``r`` at once); ``native``:
        whether the engine hands it to the backend (default: :meth:`hands_to_backend`)."""
        key = (axis, collective, nbytes, r, native)
        if key not in self._comm_cache:
            groups = self.groups(axis, r)
            if collective == "send-ring":  # every rank to the next of its group, at once
                pairs = np.array(groups)
                groups = np.stack([pairs.ravel(), np.roll(pairs, -1, axis=1).ravel()], axis=1).tolist()
                collective = "send"
            elif collective in ("reduce-scatter", "all-gather") and axis in ("dp_cp", "edp", "hpz") and self.gloo_zero:
                collective = "pairwise"  # ZeRO's direct exchanges of blocks on gloo
            if native is None:
                native = self.hands_to_backend(axis, collective)
            seconds, algorithm = self.fabric.time(collective, groups, nbytes, native=native)
            self.algorithms[f"{axis} {collective}"] = algorithm
            self._comm_cache[key] = seconds
        return self._comm_cache[key]

    def crosses_nodes(self, axis: str) -> bool:
        """Whether some group of mesh axis ``axis`` has ranks on two nodes (ranks fill nodes in order)."""
        if axis not in self._crosses:
            g = self.fabric.hw.gpus_per_node
            if axis == "hpz":
                groups = [group for r in range(self.pp) for group in self.groups(axis, r)]
            else:
                groups = self._groups.setdefault(axis, self.dims.groups(axis))
            self._crosses[axis] = any(len({rank // g for rank in group}) > 1 for group in groups)
        return self._crosses[axis]

    def hands_to_backend(self, axis: str, collective: str) -> bool:
        """Whether the engine calls the backend's own collective here (costed by the hardware's measured line
        when it has one) rather than one of ours on point-to-point messages (costed by its algorithm):

        * ours: the pipeline's sends (``parallel/pipeline/transfer.py``), ring attention's K/V passes
          (``parallel/context/ring.py``), ZeRO's reduce-scatters and all-gathers on gloo ("pairwise": direct
          exchanges, ``parallel/zero/exchange.py``) and its "had a gradient" flags there (our ring; passed by
          that site), the experts' all-to-all unless ``comm.algorithm`` is "native"
          (``parallel/expert/dispatch.py``), and the gradient buckets' all-reduce unless it is "native"
          (:attr:`native_buckets`, passed by the bucket sites);
        * the backend's: tensor and sequence parallelism's all-reduce / all-gather / reduce-scatter
          (``dist/functional.py``), the vocabulary-parallel loss, context parallelism's all-gather,
          reduce-scatter and Ulysses all-to-all, ZeRO's collectives on NCCL, and every other small
          synchronisation (loss, gradient norm, the pipeline's loss and timeline)."""
        if axis == "ep" and collective == "all-to-all":
            return self.cfg.comm.algorithm == "native"
        return collective not in ("send", "pairwise")

    @property
    def native_buckets(self) -> bool:
        """Whether the gradient buckets' all-reduce is the backend's (``comm.algorithm = "native"``)."""
        return self.cfg.comm.algorithm == "native"

    def _comm_on(self, r: int):
        return lambda axis, collective, nbytes: self.comm(axis, collective, nbytes, r)

    def send_seconds(self, src: int, dst: int, nbytes: float) -> float:
        """A point-to-point message from pipeline rank ``src`` to ``dst``: every peer pair at once."""
        key = ("send", src, dst, nbytes)
        if key not in self._comm_cache:
            lo = np.arange(src * self.per_stage, (src + 1) * self.per_stage)
            pairs = np.stack([lo, lo + (dst - src) * self.per_stage], axis=1).tolist()
            self._comm_cache[key] = self.fabric.time("send", pairs, nbytes)[0]
        return self._comm_cache[key]

    @property
    def gloo_zero(self) -> bool:
        return self.fabric.hw.backend == "gloo" and self.cfg.parallel.zero > 0

    # ---- building ----------------------------------------------------------------------------------------

    def build(self) -> Graph:
        if self.pp > 1:
            self._pipeline()
        else:
            self._one_stage()
        return self.graph

    def _task(self, r: int, name: str, kind: str, segments, deps=(), **args) -> Task:
        segments = tuple(segments)
        return self.graph.add(Task(name, kind, (r,), COMPUTE, sum(s for _, _, s in segments), list(deps),
                                   segments=segments, args=args))

    def _comm_task(self, ranks, name: str, axis: str, seconds: float, deps=(), stream: str | None = None,
                   nbytes: float = 0.0, args: dict | None = None) -> Task:
        """A collective over the groups of mesh axis ``axis`` on its stream (``stream``: another one, e.g. the
        compute stream of a blocking call); on hardware that cannot overlap, on the compute stream -- unless it
        crosses nodes and the hardware's NICs pace it beside the computation (``network_overlap``). An axis
        shown as another (:data:`AXIS_OF`) is kept in the task's ``args["group"]``."""
        hw = self.fabric.hw
        beside = hw.overlap or (stream is None and hw.network_overlap and self.crosses_nodes(axis))
        args = {**(args or {}), **({"group": axis} if axis in AXIS_OF else {})}
        axis = AXIS_OF.get(axis, axis)
        stream = (stream or axis) if beside else COMPUTE
        return self.graph.add(Task(name, name, tuple(ranks), stream, seconds, list(deps), axis=axis, nbytes=nbytes,
                                   args=args))

    def pieces(self, stage: int) -> list:
        out = [EMBED] if stage == 0 else []
        out += list(self.split[stage])
        if stage == self.pp * self.v - 1:
            out.append(HEAD)
        return out

    def _segments(self, stage: int, phase: str) -> list:
        pieces = self.pieces(stage)
        if phase != "F":
            pieces = pieces[::-1]
        return [s for pc in pieces for s in self.layers.segments(pc, phase)]

    # ---- a pipeline --------------------------------------------------------------------------------------

    def _pipeline(self) -> None:
        p = self.cfg.parallel
        schedule = build_schedule(p.pp_schedule, self.pp, self.m, self.v)
        split_backward = any(a.kind == W for acts in schedule for a in acts)
        message = self.costs.batch * self.costs.tokens * self.cfg.model.d_model * ACT_BYTES
        sent: dict[tuple, Task] = {}
        waits: list[tuple[Task, tuple]] = []
        self.last_compute: list[Task] = []
        for r, actions in enumerate(schedule):
            pending: list[tuple] = []
            previous = None
            finals = last_backward_actions(actions)
            gathers = self._param_gathers(r, by=("chunk", "piece"))
            for a in actions:
                stage = a.chunk * self.pp + r
                if a.kind in (F, B, W):
                    phase = "B-split" if a.kind == B and split_backward else a.kind
                    name = f"{a.kind}{a.mb}" + (f" c{a.chunk}" if self.v > 1 else "")
                    waiting = a.kind == F and any(k[0] == a.chunk for k in gathers)  # the chunk's first forward
                    if waiting or (a in finals and self._early_reduce):  # piece by piece: each forward piece waits
                        first = None  # for its own buckets' gathers, each bucket starts as its last piece ends
                        pieces = self.pieces(stage) if a.kind == F else self.pieces(stage)[::-1]
                        for pc in pieces:
                            previous = self._task(r, f"{name} {pc}", a.kind, self.layers.segments(pc, phase),
                                                  gathers.pop((a.chunk, pc), []) if waiting else [], stage=stage,
                                                  mb=a.mb, chunk=a.chunk)
                            first = first or previous
                            if a.kind == B:
                                self._final_tasks[(r, a.chunk, pc)] = previous
                    else:
                        first = previous = self._task(r, name, a.kind, self._segments(stage, phase), stage=stage,
                                                      mb=a.mb, chunk=a.chunk)
                    waits += [(first, key) for key in pending]
                    pending = []
                elif a.kind in (SEND_F, SEND_B):
                    dst_stage = stage + (1 if a.kind == SEND_F else -1)
                    t = self._comm_task([r], f"{a.kind} mb{a.mb}", "pp",
                                        self.send_seconds(r, a.peer, message), [previous], nbytes=message)
                    sent[(a.kind, dst_stage, a.mb)] = t
                else:
                    pending.append((SEND_F if a.kind == RECV_F else SEND_B, stage, a.mb))
            self.last_compute.append(previous)
        for task, key in waits:
            task.deps.append(sent[key])
        ends = list(self.last_compute)
        if self.cfg.model.tie_embeddings:  # the two copies of the tied table add their gradients
            first, last = 0, (self.pp * self.v - 1) % self.pp
            table = self._table_bytes()
            seconds = self.send_seconds(first, last, table)
            sync = self._comm_task([first, last], "tied grads exchange", "pp", seconds,
                                   [ends[first], ends[last]], stream="sync", nbytes=table)
            ends[first] = ends[last] = sync
        self._after_backward(ends, after_flush=True)

    def _table_bytes(self) -> float:
        m, tp = self.cfg.model, self.cfg.parallel.tp
        return 4.0 * -(-m.vocab_size // tp) * m.d_model

    # ---- one stage -----------------------------------------------------------------------------------------

    def _one_stage(self) -> None:
        p = self.cfg.parallel
        rp = self.params[0]
        pieces = self.pieces(0)
        shard = p.dp * p.cp
        zero3 = Stage3Hooks(self, 0, pieces) if p.zero == 3 and shard > 1 else None
        previous: Task | None = None
        self._bucket_tasks: list[Task] = []
        param_gathers = self._param_gathers(0)
        for mb in range(self.m):
            last = mb == self.m - 1
            if zero3:
                zero3.start(mb, backward=False)
            for pc in pieces:
                deps = [previous] if previous else []
                deps += (zero3.before(pc, deps) if zero3 else []) + param_gathers.pop(pc, [])
                previous = self._task(0, f"F{mb} {pc}", "F", self.layers.segments(pc, "F"), deps, mb=mb)
            if zero3:
                zero3.start(mb, backward=True)
            ready: set = set()
            launched = 0
            for pc in reversed(pieces):
                deps = [previous] + (zero3.before(pc, [previous]) if zero3 else [])
                previous = self._task(0, f"B{mb} {pc}", "B", self.layers.segments(pc, "B"), deps, mb=mb)
                if not last or shard == 1:
                    continue
                if zero3:  # the units whose gradients are complete: reduce-scattered
                    previous = zero3.after_backward(pc, previous)
                else:
                    ready.add(pc)
                    previous, launched = self._launch_ready(rp, ready, launched, previous)
            if last and shard > 1 and not zero3:
                previous = self._task(0, "wait for gradients", "wait", [("wait", None, 0.0)],
                                      [previous, *self._bucket_tasks])
        self._after_backward([previous], after_flush=False)

    def _launch_ready(self, rp: RankParams, ready: set, launched: int, previous: Task) -> tuple[Task, int]:
        """Launch every bucket whose gradients are all there, in bucket order (DataParallel's rule); ZeRO-2
        on gloo waits for each reduce-scatter at once."""
        p = self.cfg.parallel
        while launched < len(rp.groups) and all(rp.pieces[i] in ready for i in rp.groups[launched]):
            g = rp.groups[launched]
            if p.zero == 0:
                # the gradients and one "had a gradient" flag each
                nbytes = self.grad_bytes_per_element() * (rp.group_numel(g) + len(g))
                axis = self.unit_axis(0, g)
                t = self._comm_task([0], f"all-reduce bucket {launched}", axis,
                                    self.comm(axis, "all-reduce", nbytes, native=self.native_buckets), [previous],
                                    nbytes=nbytes)
            else:
                t = self._reduce(0, launched, [previous], f"reduce-scatter bucket {launched}")
                if not self.reduce_overlaps:  # the engine waits for it at once
                    previous = self._task(0, f"wait bucket {launched}", "wait", [("wait", None, 0.0)], [previous, t])
            self._bucket_tasks.append(t)
            launched += 1
        return previous, launched

    def unit_axis(self, r: int, unit: list[int]) -> str:
        """The group a bucket's or ZeRO unit's collectives run over: its expert replicas ("edp") for expert weights
        under expert parallelism (the engine's ``expert_group``), else the dp x cp ranks ("dp_cp")."""
        return "edp" if self.params[r].expert[unit[0]] else "dp_cp"

    def _param_gathers(self, r: int, by: tuple[str, ...] = ("piece",)) -> dict:
        """ZeRO-1/2 with ``zero_overlap_param_gather``: the all-gathers of the previous step's updated weights on
        the data-parallel stream, issued at the step's start in the engine's order; ``{piece, or (chunk, piece):
        [the gathers of the buckets holding its parameters]}`` for the forward that waits for them (empty without
        the overlap)."""
        if not self.gather_overlaps:
            return {}
        rp = self.params[r]
        lists = {"piece": rp.pieces, "chunk": rp.chunk}
        out: dict = {}
        for i in forward_order(list(range(len(rp.groups)))):
            g = rp.groups[i]
            nbytes = self.unit_bytes(r, g, padded=True)
            axis = self.unit_axis(r, g)
            t = self._comm_task([r], f"all-gather bucket {i}", axis, self.comm(axis, "all-gather", nbytes, r),
                                nbytes=nbytes)
            for j in g:
                key = tuple(lists[k][j] for k in by)
                out.setdefault(key[0] if len(key) == 1 else key, []).append(t)
        return {k: list(dict.fromkeys(v)) for k, v in out.items()}

    def unit_world(self, r: int, unit: list[int]) -> int:
        """The ranks ``unit`` is sliced over (:meth:`unit_axis`)."""
        return self.dims.size(self.unit_axis(r, unit))

    def _gather(self, r: int, u: int, deps, name: str, backward: bool = False) -> Task:
        """ZeRO-3 unit ``u``'s all-gather; in backward with hpZ, a dense unit's inside the node from the secondary
        partitions (expert units keep none: they gather from their primary slices)."""
        unit = self.params[r].groups[u]
        nbytes = self.unit_bytes(r, unit, padded=True)
        axis = self.unit_axis(r, unit)
        if backward and self.cfg.parallel.zero_hpz > 1 and axis == "dp_cp":
            axis = "hpz"
        return self._comm_task([r], name, axis, self.comm(axis, "all-gather", nbytes, r), deps, nbytes=nbytes,
                               args={"unit": u})

    def _reduce(self, r: int, u: int, deps, name: str) -> Task:
        """Unit (or bucket) ``u``'s reduce-scatter; with ZeRO-Offload its gradient slice then goes to the host (a
        side stream)."""
        unit = self.params[r].groups[u]
        nbytes = self.unit_bytes(r, unit, padded=True, grads=True)
        axis = self.unit_axis(r, unit)
        rs = self._comm_task([r], name, axis, self.comm(axis, "reduce-scatter", nbytes, r), deps, nbytes=nbytes,
                             args={"unit": u})
        p = self.cfg.parallel
        if p.offload != "none":
            shard = 4.0 * -(-self.params[r].group_numel(unit) // self.unit_world(r, unit))
            self._copies.setdefault(r, []).append(self._comm_task(
                [r], f"{name}: gradient to host", "offload", shard / self.fabric.hw.pcie_bw, [rs], stream="pcie",
                nbytes=shard))
        return rs

    def unit_bytes(self, r: int, unit: list[int], padded: bool, grads: bool = False) -> float:
        """The bytes of a bucket's or unit's parameters (``grads``: of its gradients as they travel)."""
        p = self.cfg.parallel
        world = self.unit_world(r, unit)
        n = self.params[r].group_numel(unit)
        elt = self.grad_bytes_per_element() if grads else 2.0 if p.zero_param_dtype == "bf16" else 4.0
        return elt * (-(-n // world) * world if padded else n)

    def grad_bytes_per_element(self) -> float:
        """What one gradient element weighs on the wire, as the engine reduces it (``train/engine.py``'s ``_wrap``):
        ``parallel.grad_reduce_dtype``, or with "auto" the gradients' own dtype (ZeRO's flat gradients are kept in
        ``zero_param_dtype``; plain data parallelism's are fp32, cast by ``comm.compression`` fp16 / bf16)."""
        p = self.cfg.parallel
        if p.grad_reduce_dtype != "auto":
            return 2.0 if p.grad_reduce_dtype == "bf16" else 4.0
        if p.zero:
            return 2.0 if p.zero_param_dtype == "bf16" else 4.0
        return 2.0 if self.cfg.comm.compression in ("fp16", "bf16") else 4.0

    # ---- after the backward --------------------------------------------------------------------------------

    def _after_backward(self, ends: list[Task], after_flush: bool) -> None:
        p = self.cfg.parallel
        shard = p.dp * p.cp
        for r in range(self.pp):
            rp = self.params[r]
            prev = ends[r]
            if after_flush and shard > 1:  # every bucket at once after the flush, then waited for
                deps = [prev]
                held = not self._early_reduce  # else from each piece's part of its chunk's last backward on
                for i, g in enumerate(rp.groups):
                    keys = {(r, rp.chunk[j], rp.pieces[j]) for j in g}
                    held = held or any(rp.late[j] for j in g) or any(k not in self._final_tasks for k in keys)
                    start = [prev] if held else [self._final_tasks[k] for k in sorted(keys, key=str)]
                    if p.zero == 0:
                        nbytes = self.grad_bytes_per_element() * (rp.group_numel(g) + len(g))
                        axis = self.unit_axis(r, g)
                        seconds = self.comm(axis, "all-reduce", nbytes, r, native=self.native_buckets)
                        deps.append(self._comm_task([r], f"all-reduce bucket {i}", axis, seconds, start,
                                                    nbytes=nbytes))
                    else:
                        deps.append(self._reduce(r, i, start, f"reduce-scatter bucket {i}"))
                prev = self._task(r, "wait for gradients", "wait", [("wait", None, 0.0)], deps)
            if p.zero and shard > 1:  # which parameters had a gradient (one uint8 each; our ring on gloo)
                seconds = self.comm("dp_cp", "all-reduce", float(len(rp.names)), r, native=not self.gloo_zero)
                prev = self._blocking(r, "grad flags all-reduce", "dp", seconds, prev)
            ends[r] = prev
        ends = self._sync(ends, "pp", "pipeline loss all-reduce", 8.0) if self.pp > 1 else ends
        ends = self._sync(ends, "pp", "timeline gather", 4096.0) if self.pp > 1 else ends
        # the global gradient norm: one scalar all-reduce per group the pieces are spread over
        for axis, on in (("tp", p.tp > 1), ("dp_cp", p.zero > 0 and shard > 1), ("pp", self.pp > 1)):
            if on:
                ends = self._sync(ends, axis, f"grad norm all-reduce ({axis})", 8.0)
        for r in range(self.pp):
            rp = self.params[r]
            elements = rp.total if p.zero == 0 else sum(-(-rp.group_numel(g) // self.unit_world(r, g))
                                                         for g in rp.groups)
            prev = self._optimizer(r, elements, len(rp.names), ends[r])
            if p.zero in (1, 2) and shard > 1 and not self.gather_overlaps:
                for i, g in enumerate(rp.groups):
                    axis = self.unit_axis(r, g)
                    prev = self._blocking(r, f"all-gather bucket {i}", axis,
                                          self.comm(axis, "all-gather", self.unit_bytes(r, g, True), r), prev)
            ends[r] = prev
        loss_axis = "dp_cp" if shard > 1 else None
        if loss_axis:
            ends = self._sync(ends, "dp_cp", "loss all-reduce", 8.0)
        overhead = self.fabric.hw.step_overhead
        for r in range(self.pp):
            if overhead:
                self._task(r, "step overhead", "overhead", [("overhead", None, overhead)], [ends[r]])

    def _optimizer(self, r: int, elements: float, tensors: int, prev: Task) -> Task:
        """The optimizer step on the device, or with ZeRO-Offload on the host (Ren et al. 2021 §4: after the
        gradient slices arrived; "disk" also streams the fp32 masters and moments in and out, Rajbhandari et al.
        2021 §5), the updated slice then copied back before the next forward."""
        hw, p = self.fabric.hw, self.cfg.parallel
        if p.offload == "none":
            return self._task(r, "optimizer step", "opt",
                              [("optimizer", None, self.costs.optimizer_seconds(elements, tensors))], [prev])
        host = elements * 40 / hw.host_bw + (2 * 12 * elements / hw.nvme_bw if p.offload == "disk" else 0.0)
        step = self._task(r, "optimizer step (host)", "opt", [("optimizer (host)", None, host)],
                          [prev, *self._copies.get(r, [])])
        elt = 2.0 if p.zero_param_dtype == "bf16" else 4.0
        return self._blocking(r, "weights to the device", "offload", elements * elt / hw.pcie_bw, step)

    def _blocking(self, r: int, name: str, axis: str, seconds: float, prev: Task) -> Task:
        return self._comm_task([r], name, axis, seconds, [prev], stream=COMPUTE)

    def _sync(self, ends: list[Task], axis: str, name: str, nbytes: float) -> list[Task]:
        """A small collective every pipeline rank takes part in (its groups' peers too): a synchronisation."""
        seconds = max(self.comm(axis, "all-reduce", nbytes, r) for r in range(self.pp)) if axis != "pp" else \
            self.comm("pp", "all-reduce", nbytes, 0)
        if axis == "pp":
            t = self._comm_task(range(self.pp), name, "pp", seconds, ends, stream=COMPUTE, nbytes=nbytes)
            return [t] * self.pp
        return [self._comm_task([r], name, axis, seconds, [ends[r]], stream=COMPUTE, nbytes=nbytes)
                for r in range(self.pp)]
