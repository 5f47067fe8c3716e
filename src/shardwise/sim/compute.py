"""What one micro-batch costs a GPU: every operator of the model's own code, on a roofline.

The engine's pieces of one rank (:mod:`shardwise.sim.engine_trace`: the model's blocks, embedding and head as
``parallelize`` rewrites them, on the meta device or small real CPU tensors) are run forward and backward
under a dispatch mode that records every aten operator: its FLOPs (2mnk per matrix multiplication) and the
bytes it reads and writes (views are free), and which backward products are weight gradients (the ``W`` of
a split backward, Qi et al. 2024). Each operator then takes the roofline time (Williams, Waterman &
Patterson 2009, "Roofline", CACM 52(4)):

    t = max(FLOPs / (peak * matmul_efficiency), bytes / (HBM * memory_efficiency)) + kernel_overhead

where, on a GPU with a known number of SMs (``sim.sms``), a matrix product's compute time comes from its shape
instead: tiles, waves and epilogue (:mod:`shardwise.sim.matmul`), so that small products run below
``matmul_efficiency`` as the real kernels do.

The attention core (scores, softmax, weighted sum) is traced too, as the eager reference of
``scaled_dot_product_attention`` computes it; with ``attention = "flash"`` it is costed as the fused kernel
instead (Dao et al. 2022, "FlashAttention", §3: O(s) memory traffic -- q, k, v, o and the log-sum-exp --
half the score FLOPs under a causal mask, and a backward of 2.5x the forward's FLOPs: 5 matrix
products against 2) at ``attention_efficiency``. Activations kept for backward are the bytes of the
distinct tensors autograd saves (parameters apart), measured with ``saved_tensors_hooks``.

Approximations, stated: tensors are traced in fp32 and their bytes scaled to the compute dtype (the
trainer keeps an fp32 residual stream under autocast); a mixture-of-experts block's experts are costed as
the flavour's MLP over ``tokens x top_k x imbalance`` rows (what a rank's experts process with balanced
routing) only where the block is too large to run here (:mod:`shardwise.sim.engine_trace`); where the engine's
attention core was traced as the eager reference on a flash-attention GPU, it is costed as the fused kernel over
this rank's ``1/cp`` share (``(2cp - 1) / cp`` of it on the busiest rank without head-tail balance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.sim.hardware import SimHardware
from shardwise.sim.matmul import matmul_seconds

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}
FUSED_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_flash_attention_for_cpu_backward"}
"""torch's fused CPU attention kernels (what the context-parallel ring and ``scaled_dot_product_attention`` run on a
CPU): ``4 b h s_q s_k d`` FLOPs forward, half of it under a causal mask, 2.5 times that backward (Dao et al. 2022,
§3), at ``attention_efficiency``."""


@dataclass(frozen=True)
class Op:
    """One operator: FLOPs, bytes read and written (fp32 tensors), whether it computes a weight gradient."""

    name: str
    flops: float
    bytes: float
    weight_grad: bool = False
    shape: tuple[int, int, int, int] | None = None
    """``(batch, m, n, k)`` of a matrix product ``(m x k) @ (k x n)``; None for every other operator."""


@dataclass(frozen=True)
class Trace:
    """Forward and backward operators of one module call, and the bytes autograd saved in between."""

    fwd: tuple[Op, ...]
    bwd: tuple[Op, ...]
    saved_bytes: float
    io_bytes: float = 0.0
    """Bytes of the call's inputs and output (what a fused kernel of the whole call reads and writes)."""


def measure(func, args, kwargs, out, weight_shapes=frozenset(), backward: bool = False) -> Op | None:
    """The :class:`Op` of one aten call (``None``: a view, or not an aten operator -- collectives are costed by
    the communication model)."""
    if func.is_view or func._opname in ("detach", "_unsafe_view", "lift_fresh") or func.namespace != "aten":
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
    if func._opname == "embedding":  # a gather: the rows it reads, not the whole table
        tensors = tensors[1:]
    nbytes = sum(t.numel() * 4 for t in tensors + outs)
    flops = 0.0
    name = func._opname
    shape = None
    if name in MATMULS:
        a, b = (tensors[-2], tensors[-1]) if name != "_grouped_mm" else (tensors[0], tensors[1])
        flops = 2.0 * a.numel() * b.shape[-1]
        shape = _matmul_shape(name, a, b)
    elif name in FUSED_ATTENTION:
        is_backward = name.endswith("_backward")
        q, k = (args[1], args[2]) if is_backward else (args[0], args[1])
        at = 7 if is_backward else 4
        causal = (kwargs or {}).get("is_causal", args[at] if len(args) > at else False)
        flops = 4.0 * q.numel() * k.shape[-2] * (0.5 if causal else 1.0) * (2.5 if is_backward else 1.0)
    wgrad = backward and bool(outs) and (tuple(outs[0].shape) in weight_shapes) and (name in MATMULS or name == "sum")
    return Op(name, flops, float(nbytes), wgrad, shape)


class _Recorder(TorchDispatchMode):
    def __init__(self, weight_shapes: set[tuple[int, ...]]):
        super().__init__()
        self.ops: list[Op] = []
        self.backward = False
        self.weight_shapes = weight_shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = measure(func, args, kwargs, out, self.weight_shapes, self.backward)
        if op is not None:
            self.ops.append(op)
        return out


def _matmul_shape(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)``: ``mm``/``addmm`` one product, ``bmm``/``baddbmm`` a batch, ``_grouped_mm`` the experts'
    products (rows split evenly over the experts)."""
    if name == "_grouped_mm" and b.dim() == 3:
        groups = b.shape[0]
        return groups, max(1, -(-a.shape[0] // groups)), b.shape[-1], b.shape[-2]
    batch = a.numel() // (a.shape[-2] * a.shape[-1]) if a.dim() > 2 else 1
    return batch, a.shape[-2], b.shape[-1], a.shape[-1]


def trace(fn, inputs: list[torch.Tensor], params: list[nn.Parameter]) -> Trace:
    """Run ``fn(*inputs)`` forward, then backward from its output, on the meta device, recording every operator."""
    shapes = {tuple(p.shape) for p in params if p.dim() >= 1}
    recorder = _Recorder(shapes)
    param_ids = {id(p) for p in params}
    saved: dict[int, float] = {}

    def pack(t: torch.Tensor):
        base = t if t._base is None else t._base
        if id(t) not in param_ids and id(base) not in param_ids:
            saved[id(base)] = base.numel() * 4.0
        return t

    with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
        n_fwd = len(recorder.ops)
        recorder.backward = True
        torch.autograd.backward(out, torch.empty_like(out))
    io = 4.0 * (sum(t.numel() for t in inputs) + out.numel())
    return Trace(tuple(recorder.ops[:n_fwd]), tuple(recorder.ops[n_fwd:]), sum(saved.values()), io)


@dataclass
class PassCost:
    """Seconds of one pass split into what a split backward separates, and its FLOPs."""

    seconds: float = 0.0
    wgrad_seconds: float = 0.0
    flops: float = 0.0

    def __add__(self, other: PassCost) -> PassCost:
        return PassCost(self.seconds + other.seconds, self.wgrad_seconds + other.wgrad_seconds,
                        self.flops + other.flops)

    def __sub__(self, other: PassCost) -> PassCost:
        return PassCost(self.seconds - other.seconds, self.wgrad_seconds - other.wgrad_seconds,
                        self.flops - other.flops)

    def scaled(self, k: float) -> PassCost:
        return PassCost(self.seconds * k, self.wgrad_seconds * k, self.flops * k)


@dataclass
class BlockCost:
    """One block (or the embedding, or the head and loss) for one micro-batch on one rank."""

    fwd: PassCost = field(default_factory=PassCost)
    bwd: PassCost = field(default_factory=PassCost)
    """Backward including any recomputed forward; ``wgrad_seconds`` is the part a split backward defers."""
    act_bytes: float = 0.0
    """Activations kept from forward to backward."""

    def __add__(self, other: BlockCost) -> BlockCost:
        return BlockCost(self.fwd + other.fwd, self.bwd + other.bwd, self.act_bytes + other.act_bytes)

    def __sub__(self, other: BlockCost) -> BlockCost:
        return BlockCost(self.fwd - other.fwd, self.bwd - other.bwd, self.act_bytes - other.act_bytes)

    def scaled(self, k: float) -> BlockCost:
        return BlockCost(self.fwd.scaled(k), self.bwd.scaled(k), self.act_bytes * k)


class Roofline:
    """Operator times on one GPU type (see the module docstring)."""

    def __init__(self, hw: SimHardware, precision: str):
        self.hw = hw
        self.peak = hw.peak(precision)
        self.scale = (4.0 if precision == "fp32" else 2.0) / 4.0
        """Bytes in the compute dtype per traced (fp32) byte."""

    def seconds(self, flops: float, nbytes: float, efficiency: float | None = None,
                shape: tuple[int, int, int, int] | None = None) -> float:
        """Roofline time of one kernel of ``flops`` moving ``nbytes`` (traced fp32 bytes); a matrix product of
        ``shape`` on a GPU with SMs takes its tile model's compute time (:mod:`shardwise.sim.matmul`)."""
        hw = self.hw
        if shape is not None and hw.sms > 0 and efficiency is None:
            compute = matmul_seconds(*shape, self.peak, hw.sms, hw.matmul_efficiency, 4.0 * self.scale, hw.hbm_bw)
        else:
            compute = flops / (self.peak * (efficiency or hw.matmul_efficiency))
        memory = nbytes * self.scale / (hw.hbm_bw * hw.memory_efficiency)
        return max(compute, memory) + hw.kernel_overhead

    def pass_cost(self, ops) -> PassCost:
        out = PassCost()
        for op in ops:
            t = self.seconds(op.flops, op.bytes, self.hw.attention_efficiency if op.name in FUSED_ATTENTION else None,
                             op.shape)
            out.seconds += t
            out.flops += op.flops
            if op.weight_grad:
                out.wgrad_seconds += t
        return out

    def flash(self, core: Trace, causal: bool, share: float = 1.0) -> tuple[PassCost, PassCost, float]:
        """Forward and backward of a fused attention kernel doing ``share`` of the traced core's work, and the
        bytes it keeps for backward (q, k, v, o and the log-sum-exp, about the call's inputs and output)."""
        eff = self.hw.attention_efficiency
        flops = sum(op.flops for op in core.fwd) * (0.5 if causal else 1.0) * share
        io = core.io_bytes * share
        fwd = PassCost(self.seconds(flops, io, eff), 0.0, flops)
        bwd = PassCost(self.seconds(2.5 * flops, 2 * io, eff), 0.0, 2.5 * flops)
        return fwd, bwd, io * self.scale

    def block_cost(self, tr: Trace) -> BlockCost:
        """Forward and backward seconds of a traced call, and its saved bytes in the compute dtype."""
        return BlockCost(self.pass_cost(tr.fwd), self.pass_cost(tr.bwd), tr.saved_bytes * self.scale)
