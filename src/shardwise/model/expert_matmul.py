"""All experts' linear maps at once, on tokens sorted by expert (plain single-device code).

A mixture-of-experts block hands its experts ``N`` rows sorted expert-major with ``counts[e]`` rows for
expert ``e`` and stacked weights ``[E, out, in]``. Three ways to compute every expert's ``x_e W_e^T``:

* ``grouped`` -- one grouped GEMM over the jagged groups (torch's ``F.grouped_mm``, offsets ``cumsum(counts)``
  on the device: no host synchronisation; the grouped GEMM of CUTLASS / MegaBlocks, Gale et al. 2023,
  "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", §5.1). The whole stacked weight is its
  operand, so every expert's weight is in the graph and gets a gradient (zero where it had no row) in every
  backward;
* ``padded`` -- every expert's rows copied into ``[E, C, in]`` with ``C`` the busiest expert's count, then one
  batched matmul (``torch.bmm``; GShard's dispatch tensor, Lepikhin et al. 2021, §2.2, without dropping).
  It computes ``E * C`` rows for ``N``, so it pays where the load is even (:data:`PAD_ROWS_PER_EXPERT`);
* ``loop`` -- one ``F.linear`` per expert, in a Python loop (the reference: simple, slow for many experts).

:func:`pick` chooses (``auto``): grouped where the device offers it for the dtype (probed once per device
and dtype by each :class:`Capability`), else padded when ``E * C - N <= PAD_ROWS_PER_EXPERT * E``, else the loop;
on a CPU the grouped GEMM of a half-precision model runs in fp32 (:data:`HALF`).
On this CPU (torch 2.13) the grouped GEMM is offered in fp32 and bf16, forward and backward, bit-equal to the
loop, for widths whose rows are a multiple of 16 bytes (:func:`aligned`); its backward needs a gradient
with real strides (an expanded one, as ``y.sum().backward()`` gives,
is refused), which :func:`dense_grad` provides. Its shape function (what ``torch.compile`` and fake tensors
trace with) accepts bf16 only, so a compiled fp32 model takes the other kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNELS = ("auto", "grouped", "padded", "loop")

PAD_ROWS_PER_EXPERT = 96
"""Where the grouped GEMM is not offered, the padded batched matmul is used while the rows it computes for
nothing, ``E * C - N``, are at most this many per expert: the loop pays a fixed cost per expert (its
kernels, autograd nodes and the split), about as much as ~100 rows of a 256 x 512 expert on the 2-core CPU.
Measured with ``bench/bench_moe_block.py --kernels`` (top-2 of 512 tokens, uneven loads): at 8 experts
the padded matmul beat the loop up to a padding ``E * C / N`` between 2.1 and 3.3 (this rule: 2.5); at
64 experts at every padding tried (up to 7.8; the rule allows 13)."""


HALF = (torch.bfloat16, torch.float16)
"""On a CPU, oneDNN builds (JIT-compiles) a half-precision matmul kernel for every new shape, about 1 ms each
here, and caches 1024 of them. The grouped GEMM (a loop of matmuls on the CPU) meets new row counts per expert
in every step: 64 experts x 3 matmuls (forward, two in backward) x 2 maps x 4 blocks are 1,536 shapes a step,
more than the cache holds, so in half precision it rebuilds kernels all the time (cpu-demo with 64 experts
top-8, bf16 autocast: 1.78 s of a 2.1 s forward + backward in ``mm``). So on a CPU the grouped GEMM of a
half-precision model runs in fp32 (inputs cast up, the output cast back to the half dtype, as autocast's
``linear`` would return it; more exact, not less), where no kernel is built per shape. Measured: that model's
``mm`` time fell from 1.78 s to 0.14 s; one block of 64 experts (``bench/bench_moe_block.py --kernels``, bf16,
forward + backward) 6-7 ms against 20-25 ms in bf16 and 12-21 ms padded."""


def grouped_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the grouped GEMM runs in for a layer computing in ``dtype``: fp32 on a CPU for a half dtype
    (:data:`HALF`), else ``dtype``."""
    return torch.float32 if device.type == "cpu" and dtype in HALF else dtype


class Capability:
    """Whether ``F.grouped_mm`` runs, forward and backward, on a device type and dtype: tried once on a tiny
    problem and remembered (per instance: no global state)."""

    def __init__(self):
        self.known: dict[tuple[str, torch.dtype], bool] = {}

    def grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        key = (device.type, dtype)
        if key not in self.known:
            self.known[key] = _grouped_mm_works(device, dtype)
        return self.known[key]


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        # the probe's own autograd graph, outside any caller's saved-tensor hooks: a first call inside a checkpointed
        # forward would otherwise add its tensors to what the recomputation must save again (and not save)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
            y = F.grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
            y.backward(torch.ones_like(y))
        return bool(y.shape == (4, 8) and w.grad is not None)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would compute in: autocast's where it is on for ``x``'s device (``grouped_mm``
    and ``bmm`` are cast by hand -- the grouped GEMM is on no autocast list), else ``x``'s."""
    kind = x.device.type
    on = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    return torch.get_autocast_dtype(kind) if on else x.dtype


class ExpertRows:
    """The layout of ``rows`` tokens sorted by expert, ``counts [E]`` (a tensor on the tokens' device)."""

    def __init__(self, counts: torch.Tensor, rows: int):
        self.counts, self.rows = counts, rows
        self.ends = counts.cumsum(0)
        self._expert: torch.Tensor | None = None
        self._slot: tuple[torch.Tensor, torch.Tensor, int] | None = None

    @property
    def offsets(self) -> torch.Tensor:
        """``int32`` end of each expert's run (the grouped GEMM's ``offs``)."""
        return self.ends.to(torch.int32)

    @property
    def expert(self) -> torch.Tensor:
        """``[rows]``: the expert of each row (``output_size`` given, so no host sync)."""
        if self._expert is None:
            ids = torch.arange(self.counts.numel(), device=self.counts.device)
            self._expert = torch.repeat_interleave(ids, self.counts, output_size=self.rows)
        return self._expert

    def slots(self) -> tuple[torch.Tensor, int]:
        """Each row's place ``expert * C + position in its expert's run`` in the padded ``[E * C]`` rows, and the
        busiest count ``C`` (a host sync)."""
        if self._slot is None:
            c = int(self.counts.max()) if self.rows else 0
            starts = self.ends - self.counts
            position = torch.arange(self.rows, device=self.counts.device) - starts[self.expert]
            self._slot = (self.expert * c + position, c)
        return self._slot

    def wasted(self) -> int:
        """``E * C - N``: the rows the padded matmul would compute for nothing (a host sync)."""
        return self.counts.numel() * self.slots()[1] - self.rows

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, d]`` as ``[E, C, d]``, zeros after each expert's run. (``index_copy`` / ``index_select``, not
        advanced indexing: the backward of an indexed read is an accumulating ``index_put``, several times slower
        on a CPU than ``index_select``'s ``index_add``.)"""
        place, c = self.slots()
        e, d = self.counts.numel(), x.shape[-1]
        return x.new_zeros(e * c, d).index_copy(0, place, x).view(e, c, d)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """The rows of the padded ``y [E, C, d]`` that hold real tokens, in expert-major order."""
        return y.reshape(-1, y.shape[-1]).index_select(0, self.slots()[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: ExpertRows
                   ) -> torch.Tensor:
    """``x_e W_e^T + b_e`` for every expert's run of ``x [N, in]`` in one grouped GEMM (``weight [E, out, in]``)."""
    dtype = compute_dtype(x)
    run = grouped_dtype(x.device, dtype)
    y = F.grouped_mm(x.to(run), weight.to(run).transpose(-2, -1), offs=rows.offsets)
    y = y if bias is None else y + bias.to(run).index_select(0, rows.expert)
    return y.to(dtype)


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [E, C, in]`` padded runs through their experts' maps by one ``bmm``."""
    dtype = compute_dtype(x)
    y = torch.bmm(x.to(dtype), weight.to(dtype).transpose(1, 2))
    return y if bias is None else y + bias.to(dtype)[:, None, :]


def aligned(widths: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether rows of every width (the experts' ``in`` and ``out`` sizes) are a multiple of 16 bytes long: the
    grouped GEMM refuses other strides ("strides should be multiple of 16 bytes"; e.g. bf16 widths of 8 k)."""
    size = torch.empty((), dtype=dtype).element_size()
    return all(w * size % 16 == 0 for w in widths)


def pick(kernel: str, capability: Capability, x: torch.Tensor, rows: ExpertRows, widths: tuple[int, ...]) -> str:
    """The kernel ``auto`` stands for (module docstring) for rows ``x`` through experts whose maps have these
    ``widths``; an explicit kernel is returned as it is."""
    if kernel != "auto":
        return kernel
    run = grouped_dtype(x.device, compute_dtype(x))
    traceable = run == torch.bfloat16 or not torch.compiler.is_compiling()  # torch's meta kernel: bf16 only
    if traceable and aligned(widths, run) and capability.grouped(x.device, run):
        return "grouped"
    if rows.wasted() <= PAD_ROWS_PER_EXPERT * rows.counts.numel():
        return "padded"
    return "loop"


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a gradient with real strides (the grouped GEMM refuses stride 0)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def dense_grad(x: torch.Tensor) -> torch.Tensor:
    return _DenseGrad.apply(x) if x.requires_grad else x
