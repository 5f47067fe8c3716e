"""Tensor- and sequence-parallel communication overlapped with the matmul next to it, by decomposition.

Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models" (ASPLOS'23), §3-4: a collective whose result feeds a matmul (all-gather -> matmul), or whose input a
matmul produces (matmul -> reduce-scatter), is cut along the dimension the collective splits -- here the
sequence, into one chunk per tensor-parallel rank -- and replaced by point-to-point steps: in step k rank r
sends to rank r + k and receives from rank r - k (the pairwise exchange of Thakur, Rabenseifner & Gropp 2005
§4), each step posted one chunk ahead, so that chunk k travels while chunk k - 1 is multiplied. PyTorch's
async tensor parallelism ("micro-pipelining" of all-gather / reduce-scatter matmuls) does the same.

Where it applies (``parallel.tp_comm_overlap``), with sequence parallelism (Korthikanti et al. 2022 §4.2.2):

* entering a region: the sequence all-gather and the first column-parallel projection that reads it
  (:func:`enter_linear`): forward, the rank's own chunk is multiplied while the others arrive; backward, the
  input gradient (this projection's plus the region's other projections', already summed by autograd) is
  computed chunk by chunk and each chunk sent to the rank owning those tokens (a reduce-scatter);
* leaving a region: the row-parallel projection and its reduce-scatter (:func:`linear_leave`): forward, the
  rows of the sequence bound for rank r + k are multiplied and sent while the next rank's are multiplied;
  backward, the output gradient is all-gathered chunk by chunk beside the input-gradient matmuls.

Without sequence parallelism the collectives are all-reduces: the row projection's output and the region's
input gradient are all-reduced a sequence chunk at a time, each launched as soon as its chunk is computed.

Every rank sums what it receives in rank order, so all ranks agree; the sums differ from the backend's
collectives in the last bits (rounding), and the matmuls are cut by rows. On GPUs the point-to-point
messages run on NCCL's own stream, the compute stream waiting for a chunk only where it is used; on CPU
ranks they travel on gloo's transport threads while the compute thread multiplies. Every message is counted
(``stats.send``) and every wait timed (``stats.waiting``, the axis's ``tp_exposed_s``).

Not with ``torch.compile`` nor with the zb-h1 schedule's deferred weight gradients (refused by the config).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.dist.comm.counting import CommStats, nbytes
from shardwise.dist.functional import SEQ_DIM

TAG = 1 << 21
"""Message tag of the decomposed collectives (the tensor-parallel group's own point-to-point traffic)."""


def _autocast(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``F.linear`` would compute in here (``torch.autocast``), or None (also on devices without
    autocast: the simulator's meta tensors)."""
    device = x.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _plain(dtype: torch.dtype | None, x: torch.Tensor):
    """Autocast off while computing in ``dtype`` by hand (nothing to turn off without autocast)."""
    return torch.autocast(x.device.type, enabled=False) if dtype is not None else contextlib.nullcontext()


def _cast(dtype: torch.dtype | None, *tensors):
    return tuple(t if t is None or dtype is None else t.to(dtype) for t in tensors)


class Steps:
    """The communication of a decomposed collective over ``group``: pairwise steps (step k sends to rank r + k and
    receives from rank r - k) or chunk all-reduces, and the waits for them. The three schedules below call only
    this, so the simulator runs them on a clock of its own (:mod:`shardwise.sim.layers`)."""

    def __init__(self, group, stats: CommStats | None):
        self.group, self.stats = group, stats if stats is not None else CommStats()
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def peer(self, k: int) -> tuple[int, int]:
        """``(destination, source)`` of step k (group ranks)."""
        return (self.rank + k) % self.n, (self.rank - k) % self.n

    def post(self, k: int, send: torch.Tensor, recv: torch.Tensor) -> list:
        dst, src = self.peer(k)
        self.stats.send(nbytes(send))
        glob = dist.get_global_rank
        return dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, glob(self.group, src), self.group, TAG),
                                       dist.P2POp(dist.isend, send, glob(self.group, dst), self.group, TAG)])

    def all_reduce(self, piece: torch.Tensor):
        """Launch the backend's all-reduce (sum) of ``piece`` in place, asynchronously."""
        self.stats.hand(nbytes(piece), backend=True)
        return dist.all_reduce(piece, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def wait(self, works: list) -> None:
        with self.stats.waiting():
            for w in works:
                w.wait()


def _seq_chunks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.chunk(n, dim=SEQ_DIM))


def gather_then(steps: Steps, local: torch.Tensor, compute) -> list[torch.Tensor]:
    """All-gather ``local`` along the sequence by pairwise steps, calling ``compute(j, chunk_j)`` on the rank's
    own chunk first and on rank j's as it arrives, each step posted one chunk ahead; the chunks by rank."""
    n = steps.n
    chunks: list[torch.Tensor | None] = [None] * n
    chunks[steps.rank] = local
    bufs = [torch.empty_like(local) for _ in range(n - 1)]
    works = steps.post(1, local, bufs[0]) if n > 1 else []
    compute(steps.rank, local)
    for k in range(1, n):
        steps.wait(works)
        if k + 1 < n:
            works = steps.post(k + 1, local, bufs[k])
        src = steps.peer(k)[1]
        chunks[src] = bufs[k - 1]
        compute(src, bufs[k - 1])
    return chunks


def then_reduce_scatter(steps: Steps, produce) -> torch.Tensor:
    """Reduce-scatter along the sequence by pairwise steps: ``produce(j)`` computes this rank's partial result for
    rank j's chunk, sent while the next one is computed (one step in flight); the own chunk is computed last
    and the partials are added in rank order, so every rank adds its tokens' partials alike."""
    n = steps.n
    received: list[torch.Tensor | None] = [None] * n
    works: list = []
    for k in range(1, n):
        dst, src = steps.peer(k)
        part = produce(dst).contiguous()
        steps.wait(works)  # the previous step is done: its message buffer may go
        received[src] = torch.empty_like(part)
        works = steps.post(k, part, received[src])
    received[steps.rank] = produce(steps.rank)
    steps.wait(works)
    out = received[0].clone()
    for b in received[1:]:
        out.add_(b)
    return out


def then_all_reduce(steps: Steps, pieces) -> torch.Tensor:
    """``pieces``: an iterator of sequence chunks, each all-reduced (the backend's, asynchronously) as soon as it
    is produced, while the next is computed; the sum, concatenated along the sequence."""
    works, outs = [], []
    for piece in pieces:
        piece = piece.contiguous()
        works.append(steps.all_reduce(piece))
        outs.append(piece)
    steps.wait(works)
    return torch.cat(outs, dim=SEQ_DIM)


def _full_bytes(t: torch.Tensor, features: int, dtype: torch.dtype) -> int:
    """Bytes of a tensor shaped as ``t`` but with ``features`` in its last dim and elements of ``dtype``."""
    return t.numel() // t.shape[-1] * features * torch.empty((), dtype=dtype).element_size()


class _EnterLinear(torch.autograd.Function):
    """Enter the region and apply its first column-parallel projection: ``(y, x_full)``, where ``x_full`` is the
    region's input (gathered along the sequence with sequence parallelism) for its other projections."""

    @staticmethod
    def forward(ctx, x, weight, bias, steps, sp):
        dtype = _autocast(x)
        w, b = _cast(dtype, weight, bias)
        ctx.dtypes, ctx.steps, ctx.sp = (x.dtype, weight.dtype), steps, sp
        with _plain(dtype, x):
            if not sp:
                ctx.save_for_backward(_cast(dtype, x)[0], w)
                return F.linear(_cast(dtype, x)[0], w, b), x.view_as(x)
            ys: list[torch.Tensor | None] = [None] * steps.n
            steps.stats.hand(nbytes(x) * steps.n, backend=False)

            def project(j: int, chunk: torch.Tensor) -> None:
                ys[j] = F.linear(_cast(dtype, chunk)[0], w, b)

            chunks = gather_then(steps, x.contiguous(), project)
            full = torch.cat(chunks, dim=SEQ_DIM)
            ctx.save_for_backward(_cast(dtype, full)[0], w)
            return torch.cat(ys, dim=SEQ_DIM), full

    @staticmethod
    def backward(ctx, grad_y, grad_full):
        x, w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        steps = ctx.steps
        grad_y = grad_y.to(w.dtype)
        n = steps.n if ctx.sp else min(steps.n, grad_y.shape[SEQ_DIM])
        gys = _seq_chunks(grad_y, n)
        extra = _seq_chunks(grad_full, n) if grad_full is not None else None

        def grad_in(j: int) -> torch.Tensor:
            """Chunk j of the region input's gradient: this projection's plus the region's other projections'."""
            out = gys[j].matmul(w).to(x_dtype)
            return out if extra is None else out + extra[j]

        if ctx.sp:
            steps.stats.hand(_full_bytes(grad_y, w.shape[1], x_dtype), backend=False)
            grad_x = then_reduce_scatter(steps, grad_in)
        else:
            grad_x = then_all_reduce(steps, (grad_in(j) for j in range(n)))
        dy = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = dy.t().mm(x.reshape(-1, x.shape[-1])).to(w_dtype)
        grad_b = dy.sum(0).to(w_dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


class _LinearLeave(torch.autograd.Function):
    """A row-parallel projection ``x W^T`` and the collective leaving the region (sequence parallelism: the
    reduce-scatter along the sequence; else the all-reduce), decomposed; the bias is added by the caller."""

    @staticmethod
    def forward(ctx, x, weight, steps, sp):
        dtype = _autocast(x)
        xc, w = _cast(dtype, x, weight)
        ctx.save_for_backward(xc, w)
        ctx.dtypes, ctx.steps, ctx.sp = (x.dtype, weight.dtype), steps, sp
        chunks = _seq_chunks(xc, steps.n)
        with _plain(dtype, x):
            if sp:
                if x.shape[SEQ_DIM] % steps.n:
                    raise ValueError(f"sequence parallelism: sequence length {x.shape[SEQ_DIM]} does not divide by "
                                     f"tp={steps.n}")
                steps.stats.hand(_full_bytes(xc, w.shape[0], xc.dtype), backend=False)
                return then_reduce_scatter(steps, lambda j: F.linear(chunks[j], w))
            chunks = _seq_chunks(xc, min(steps.n, x.shape[SEQ_DIM]))
            return then_all_reduce(steps, (F.linear(c, w) for c in chunks))

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        grad_out = grad_out.to(w.dtype)
        if not ctx.sp:  # the all-reduce's adjoint is the identity
            grad_x = grad_out.matmul(w).to(x_dtype)
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])).to(w_dtype)
            return grad_x, grad_w, None, None
        steps = ctx.steps
        xs = _seq_chunks(x, steps.n)
        grad_x: list[torch.Tensor | None] = [None] * steps.n
        grad_w = torch.zeros(w.shape, dtype=w_dtype, device=w.device)  # the chunks' products, in the weight's dtype
        steps.stats.hand(nbytes(grad_out) * steps.n, backend=False)

        def backward_chunk(j: int, g: torch.Tensor) -> None:
            grad_x[j] = g.matmul(w).to(x_dtype)
            grad_w.add_(g.reshape(-1, g.shape[-1]).t().mm(xs[j].reshape(-1, x.shape[-1])).to(w_dtype))

        gather_then(steps, grad_out.contiguous(), backward_chunk)
        return torch.cat(grad_x, dim=SEQ_DIM), grad_w, None, None


def enter_linear(x: torch.Tensor, weight, bias, steps: Steps, sequence_parallel: bool):
    """``(y, x_full)``: the region's first column-parallel projection of ``x`` (this rank's piece of the sequence
    with sequence parallelism, else the replicated input) and the region's input for its other projections,
    communicating through ``steps`` (:class:`Steps` over the tensor-parallel group)."""
    return _EnterLinear.apply(x, weight, bias, steps, sequence_parallel)


def linear_leave(x: torch.Tensor, weight, steps: Steps, sequence_parallel: bool) -> torch.Tensor:
    """The row-parallel ``x W^T`` summed over the group of ``steps`` (reduce-scattered along the sequence with
    sequence parallelism), decomposed as the module docstring says."""
    return _LinearLeave.apply(x, weight, steps, sequence_parallel)


class OverlappedRegion:
    """The entry of a region whose input feeds several column-parallel projections (attention's q, k, v; the
    MLP's gate and up), with ``parallel.tp_comm_overlap``: a forward pre-hook that hands the module a stand-in of
    the entered input's shape (NaNs without storage: any read other than through the region's projections shows
    as NaN), the first projection entering the region with its matmul (:func:`enter_linear`), the others using
    the input it entered; a forward hook forgets them."""

    def __init__(self, group, stats: CommStats | None, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.steps = Steps(group, stats)
        self.local = self.full = self.stand_in = None

    def __call__(self, module, args: tuple) -> tuple:
        x = args[0]
        n = dist.get_world_size(self.group) if self.sequence_parallel else 1
        shape = (*x.shape[:SEQ_DIM], x.shape[SEQ_DIM] * n, *x.shape[SEQ_DIM + 1:])
        self.local, self.full = x, None
        self.stand_in = x.new_full((1,) * x.dim(), float("nan")).expand(shape)
        return (self.stand_in, *args[1:])

    def leave(self, module, args, output) -> None:
        self.local = self.full = self.stand_in = None

    def project(self, x: torch.Tensor, layer) -> torch.Tensor:
        """``layer``'s projection of the region's input (``x``: the stand-in the pre-hook handed out)."""
        if x is not self.stand_in:
            raise RuntimeError(f"{type(layer).__name__}: with parallel.tp_comm_overlap a region's column-parallel "
                               "projections must read the region's input itself")
        if self.full is None:
            y, self.full = enter_linear(self.local, layer.weight, layer.bias, self.steps, self.sequence_parallel)
            return y
        return layer.local_linear(self.full, layer.weight, layer.bias)
