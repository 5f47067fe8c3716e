"""Tensor-parallel communication decomposed with its matmuls (``parallel.tp_comm_overlap``), on the simulator's clock.

The engine cuts a region's entry with its first column-parallel projection, and every row-parallel projection with
its reduction, into one chunk per tensor-parallel rank, chunk k travelling while chunk k - 1 is multiplied
(:mod:`shardwise.parallel.tensor.overlap`; Wang et al. 2022). What that hides depends on the matmul's time beside
each chunk's transfer, so the simulator runs the engine's own code rather than a formula of it: it builds one block
and the head of the engine's tensor-parallel layers on the meta device (mirror groups, as
:mod:`shardwise.sim.engine_trace` does), finds the decomposed sites the layers hold -- each region's first
projection, every row-parallel projection, the vocabulary head -- and runs their autograd functions forward and
backward with a :class:`SimulatedSteps` in place of the process group:

* every aten operator advances the compute clock by its roofline time (:func:`shardwise.sim.compute.measure`,
  :meth:`~shardwise.sim.compute.Roofline.seconds`);
* a pairwise step posted at time t arrives at t plus the fabric's time of every rank sending its chunk to a peer at
  once (``send-ring`` on the tp groups); chunk all-reduces run one after another on the tp stream;
* a wait moves the compute clock to the transfer's end. On hardware without overlap (CPU ranks) a transfer takes the
  compute thread for its whole time.

What the clock waited is the site's exposed communication: the block's matmuls themselves are in its traced compute
already (traced without the decomposition, :func:`shardwise.sim.engine_trace.engine_traces`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.config import Config
from shardwise.dist.comm.counting import CommLedger, CommStats
from shardwise.sim.compute import Roofline, measure


class _Clock(TorchDispatchMode):
    """The compute thread's clock: every aten operator takes its roofline time."""

    def __init__(self, roofline: Roofline):
        super().__init__()
        self.roofline = roofline
        self.t = self.busy = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = measure(func, args, kwargs, out)
        if op is not None:
            dt = self.roofline.seconds(op.flops, op.bytes)
            self.t += dt
            self.busy += dt
        return out


class SimulatedSteps:
    """A :class:`~shardwise.parallel.tensor.overlap.Steps` on the clock: a handle is the time its transfer ends."""

    def __init__(self, n: int, clock: _Clock, comm, scale: float, blocking: bool):
        self.n, self.rank, self.clock, self.comm, self.scale, self.blocking = n, 0, clock, comm, scale, blocking
        self.stats = CommStats()
        self.free = 0.0
        """When the tp stream's last all-reduce ends."""

    def peer(self, k: int) -> tuple[int, int]:
        return k % self.n, -k % self.n

    def _transfer(self, start: float, seconds: float) -> float:
        if self.blocking:  # the transfer takes the compute thread
            self.clock.t = max(self.clock.t, start) + seconds
            return self.clock.t
        return start + seconds

    def post(self, k: int, send: torch.Tensor, recv: torch.Tensor) -> list[float]:
        return [self._transfer(self.clock.t, self.comm("tp", "send-ring", send.numel() * 4.0 * self.scale))]

    def all_reduce(self, piece: torch.Tensor) -> float:
        self.free = self._transfer(max(self.clock.t, self.free),
                                   self.comm("tp", "all-reduce", piece.numel() * 4.0 * self.scale))
        return self.free

    def wait(self, works: list[float]) -> None:
        self.clock.t = max([self.clock.t, *works])


def _sites(model) -> dict[str, tuple]:
    """The decomposed sites of a tensor-parallel model the engine built: ``{path: (layer, kind)}`` with kind "enter"
    (a region's first projection, or a head entering the region itself) or "leave" (a row-parallel projection)."""
    from shardwise.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    out, regions = {}, set()
    for path, m in model.named_modules():
        if isinstance(m, ColumnParallelLinear) and m.region is not None and id(m.region) not in regions:
            regions.add(id(m.region))
            out[path] = (m, "enter")
        elif isinstance(m, ColumnParallelLinear) and m.steps is not None:
            out[path] = (m, "enter")
        elif isinstance(m, RowParallelLinear) and m.steps is not None:
            out[path] = (m, "leave")
    return out


def decomposed_exposure(cfg: Config, roofline: Roofline, batch: int, comm, overlap: bool) -> dict[str, tuple]:
    """``{path: (forward seconds, backward seconds)}`` exposed by each decomposed site of one block (paths under
    ``blocks.0``) and of the head (``lm_head``), per micro-batch of ``batch`` sequences."""
    from shardwise.model.transformer import Transformer
    from shardwise.parallel.parallelize import parallelize
    from shardwise.parallel.tensor.overlap import enter_linear, linear_leave
    from shardwise.sim.engine_trace import trace_dims
    from shardwise.sim.mirror import mirror_mesh

    p, m = cfg.parallel, cfg.model
    dense = dataclasses.replace(m, n_experts=0, n_layers=1)
    plain = dataclasses.replace(cfg, model=dense, train=dataclasses.replace(cfg.train, recompute="none", compile=False))
    sp = p.sequence_parallel
    tokens = cfg.data.seq_len // p.cp
    with mirror_mesh(trace_dims(cfg)) as mesh:
        with torch.device("meta"):
            model = Transformer(dense)
        parallelize(model, mesh, plain, CommLedger())
        out = {}
        for path, (layer, kind) in _sites(model).items():
            clock = _Clock(roofline)
            steps = SimulatedSteps(p.tp, clock, comm, roofline.scale, blocking=not overlap)
            features = layer.weight.shape[1]
            rows = tokens // p.tp if sp and kind == "enter" else tokens
            x = torch.empty(batch, rows, features, device="meta", requires_grad=True)
            with clock:
                if kind == "enter":
                    outs = enter_linear(x, layer.weight, layer.bias, steps, sp)
                    outs = outs if path.startswith("blocks.") else outs[:1]  # the head has no other projection
                else:
                    outs = (linear_leave(x, layer.weight, steps, sp),)
            forward = clock.t - clock.busy
            clock.t = clock.busy = steps.free = 0.0
            with clock:
                torch.autograd.backward(list(outs), [torch.empty_like(o) for o in outs])
            out[path] = (forward, clock.t - clock.busy)
    return out


__all__ = ["SimulatedSteps", "decomposed_exposure"]
