"""Data parallelism: identical replicas, gradients averaged by bucketed all-reduce overlapped with backward.

The design follows Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training" (VLDB 13(12)), which describes torch's DistributedDataParallel:

* replicas start equal: parameters and buffers are broadcast from one rank (§3.2.1);
* gradients are averaged with all-reduce over *buckets* of parameters instead of one
  collective per tensor, because small all-reduces are latency bound (§3.2.2, Fig. 2);
* buckets are filled in reverse registration order, roughly the order in which backward
  produces gradients, and a bucket's all-reduce is launched from autograd hooks as soon
  as all of its gradients are ready, so communication overlaps the rest of backward
  (§3.2.3); buckets are launched in the same order on every rank, since collectives
  must match across ranks;
* parameters that receive no gradient in an iteration are reduced as zeros at the end
  of backward so that no rank waits forever (§3.2.3, "find_unused_parameters");
* ``no_sync`` skips synchronisation to accumulate gradients locally (§3.2.4).

Semantics of unused parameters (the same as torch DDP with ``find_unused_parameters``):
a parameter whose ``.grad`` is ``None`` on this rank contributes zeros; if it has a
gradient on *some* rank, every rank ends with the average as its ``.grad``; if it has
none on *any* rank its ``.grad`` stays ``None`` (so optimizers skip it, as they would
in a single process). Each bucket carries one extra element per parameter, a "has a
gradient" flag summed by the same all-reduce, to tell these cases apart.

After synchronisation each ``param.grad`` *is* a view into its bucket (torch DDP's
``gradient_as_bucket_view``): no copy back, and no second copy of the gradients.
Reentrant activation checkpointing is not supported (a parameter's gradient would be
accumulated in several inner backward passes); use ``use_reentrant=False``.

Overlap with algorithms other than the backend's: an ``all_reduce_fn`` may block (our
point-to-point algorithms in :mod:`shardwise.dist.comm` do). Unless it is the native one,
each bucket's call is handed to a communication thread (:class:`~shardwise.dist.comm.background.CommThread`)
that runs them one at a time in launch order -- the same order on every rank -- while
backward computes the next gradients; the thread is joined at the end of backward, and an
error raised in it is re-raised from ``backward()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.background import CommThread, Job
from shardwise.dist.comm.counting import CommStats

AllReduceFn = Callable[[torch.Tensor, "dist.ProcessGroup | None"], "dist.Work | None"]
"""``fn(tensor, group) -> Work | None``: sum ``tensor`` in place over ``group``; may return
an async handle to wait on. The one seam through which other all-reduce algorithms plug in."""


def start_native_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    """The backend's own all-reduce (sum), launched asynchronously."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


@torch.no_grad()
def broadcast_module(module: nn.Module, group: dist.ProcessGroup | None = None, src: int = 0,
                     bucket_bytes: int = 25 * 2**20) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s (a rank of ``group``).

    Tensors are packed into flat buffers of at most ``bucket_bytes`` per dtype and device
    so that a model costs a few broadcasts rather than one per tensor.
    """
    broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), group, src, bucket_bytes)


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None, src: int = 0,
                      bucket_bytes: int = 25 * 2**20) -> None:
    """Overwrite ``tensors`` with rank ``src``'s (a rank of ``group``), packed as :func:`broadcast_module` says."""
    if group is not None and dist.get_world_size(group) == 1:
        return
    global_src = src if group is None else dist.get_global_rank(group, src)
    for chunk in _chunks(tensors, bucket_bytes):
        flat = torch.cat([t.reshape(-1) for t in chunk])
        wire = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
        dist.broadcast(wire, src=global_src, group=group)
        if dist.get_rank() != global_src:
            for t, piece in zip(chunk, flat.split([t.numel() for t in chunk]), strict=True):
                t.copy_(piece.view_as(t))


def _chunks(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Split ``tensors`` into runs of one dtype and device, each closed once it reaches ``cap_bytes``."""
    open_: dict[tuple, list[torch.Tensor]] = {}
    sizes: dict[tuple, int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        open_.setdefault(key, []).append(t)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        if sizes[key] >= cap_bytes:
            yield open_.pop(key)
            sizes.pop(key)
    yield from open_.values()


@dataclass(eq=False)
class _Bucket:
    """A flat buffer holding several parameters' gradients, reduced by one collective."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    """``[grad_0, grad_1, ..., has_grad flags]``: the gradients, then one flag per parameter."""
    views: list[torch.Tensor]
    """Per parameter: its slice of ``buffer``, shaped like the parameter."""
    flags: torch.Tensor
    pending: int = 0
    """Parameters whose gradient is not ready yet in this backward pass."""
    work: dist.Work | Job | None = None
    """What the launch returned: an async handle, or the communication thread's job."""
    group: dist.ProcessGroup | None = None
    """The group this bucket is reduced over (the data-parallel group, or an expert one)."""
    reduce: bool = True
    """Whether that group has more than one rank (else the gradient is only divided)."""
    ready: list[bool] = field(default_factory=list)
    """Per parameter: whether its gradient came in this backward pass."""


def _assign_buckets(params: list[nn.Parameter], cap_bytes: int, kind=lambda p: 0,
                    last_bytes: int | None = None) -> list[list[nn.Parameter]]:
    """Group parameters into buckets, in reverse registration order (roughly the order backward produces
    their gradients).

    One bucket holds one dtype and device, and parameters of one ``kind`` (one reduction group). torch DDP
    closes a bucket once it reaches the cap, front to back, so its last bucket -- launched only when backward
    ends, its all-reduce overlapping nothing -- is whatever remains, up to the cap. Here buckets are cut back
    to front with growing limits, ``last_bytes``, twice that, ... up to ``cap_bytes`` (a bucket closes once
    adding the next parameter would pass its limit; a parameter larger than the limit gets a bucket of its
    own): what is left to communicate when backward ends is about ``last_bytes``, the buckets before it
    overlap the last layers' backward, and a model still costs few all-reduces (a few more than ``size /
    cap``). With ``last_bytes`` None (the default) or ``>= cap_bytes``, or parameters of several dtypes or
    devices, buckets are cut front to back as torch DDP does. Buckets are ordered by their first parameter, so
    the order is the same on every rank.
    """
    order = list(reversed(params))
    kinds = dict.fromkeys(kind(p) for p in order)
    buckets = [b for k in kinds for b in _cut([p for p in order if kind(p) == k], cap_bytes, last_bytes)]
    position = {id(p): i for i, p in enumerate(order)}
    return sorted(buckets, key=lambda b: position[id(b[0])])


def _cut(ordered: list[nn.Parameter], cap_bytes: int, last_bytes: int | None) -> list[list[nn.Parameter]]:
    """Buckets of ``ordered`` (one kind) as :func:`_assign_buckets` says."""
    if last_bytes is None or last_bytes >= cap_bytes or len({(p.dtype, p.device) for p in ordered}) != 1:
        return list(_chunks(ordered, cap_bytes))
    buckets: list[list[nn.Parameter]] = []
    limit, end = last_bytes, len(ordered)
    while end > 0:
        start, size = end - 1, ordered[end - 1].numel() * ordered[end - 1].element_size()
        while start > 0 and size + ordered[start - 1].numel() * ordered[start - 1].element_size() <= limit:
            start -= 1
            size += ordered[start].numel() * ordered[start].element_size()
        buckets.append(ordered[start:end])
        end, limit = start, min(2 * limit, cap_bytes)
    return buckets[::-1]


def _weak_hook(dp: DataParallel, bucket: _Bucket, pos: int) -> Callable[[nn.Parameter], None]:
    """The gradient hook of parameter ``pos`` of ``bucket``; it does not keep ``dp`` alive: once the wrapper is
    gone, the module trains alone. (Where the gradient goes is bound here, so a call looks nothing up.)"""
    ref = weakref.ref(dp)

    def hook(param: nn.Parameter) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(bucket, pos)

    return hook


class DataParallel(nn.Module):
    """Replicate ``module`` over ``group`` and average its gradients during backward.

    Usage is that of a plain module: ``loss = dp(x); loss.backward(); opt.step()``. When
    ``backward()`` returns, every ``param.grad`` holds the average over the group, so
    the caller can clip and step at once. Inside ``with dp.no_sync():`` backward only
    accumulates ``.grad`` locally; the next backward outside it reduces the sum.

    Wrap the model after moving it to its device (bucket buffers are allocated there),
    and keep its parameters dense (sparse gradients are not supported).

    Args:
        module: the model; its parameters stay where they are (no copies).
        group: the data-parallel process group (``None``: the default group).
        bucket_mb: bucket size in MiB; smaller buckets start communicating earlier.
        last_bucket_mb: the bucket of the gradients backward produces last holds at most this many MiB, the one
            before it twice as many, ... up to ``bucket_mb`` (:func:`_assign_buckets`): less communication is
            left when backward ends, for a few more all-reduces. ``None`` (default): torch DDP's cut. On the
            2-core CPU with gloo, 1 MiB cost 1-2 % of the step (README, data parallelism), so it is not the
            default there.
        broadcast_from: rank *within group* whose weights every replica starts from.
        all_reduce_fn: ``fn(flat, group) -> Work | None`` summing ``flat`` in place;
            default the backend's native all-reduce. (Other algorithms plug in here.)
        comm_thread: call ``all_reduce_fn`` on a background thread so that a blocking
            algorithm overlaps backward; default: for every fn that does not return the backend's
            asynchronous handle (the native all-reduce, or a fn whose ``asynchronous`` is true).
        expert_group: with expert parallelism, the ranks holding the same experts (mesh axis ``edp``):
            parameters marked ``p.ep_shard`` (:mod:`shardwise.parallel.expert.dispatch`) are bucketed apart,
            broadcast and summed over it, and divided by the size of ``group`` like every gradient (each
            expert's gradient already holds the tokens of its whole ep group).
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, bucket_mb: float = 25.0,
                 broadcast_from: int = 0, all_reduce_fn: AllReduceFn | None = None, comm_thread: bool | None = None,
                 expert_group: dist.ProcessGroup | None = None, last_bucket_mb: float | None = None,
                 comm_stats: CommStats | None = None):
        super().__init__()
        self.comm_stats = comm_stats if comm_stats is not None else CommStats()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._scale = 1.0 / self.world_size
        self.all_reduce_fn = all_reduce_fn or start_native_all_reduce
        self.comm_bytes_last_step = 0
        """Bytes handed to all-reduce in the last synchronisation (gradients plus flags)."""
        self.overlapped_buckets_last_step = 0
        """Buckets of the last synchronisation launched while backward was still running."""
        self._sync = True
        self._final = False
        """Inside :meth:`final_backward`: a pipeline chunk's last backward, whose gradients are final."""
        self._late: set[int] = set()
        """Buckets a pipeline changes after its last backward (the tied table's): reduced after the flush."""
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._buckets: list[_Bucket] = []
        self._hooks = []
        asynchronous = getattr(self.all_reduce_fn, "asynchronous", self.all_reduce_fn is start_native_all_reduce)
        threaded = not asynchronous if comm_thread is None else comm_thread
        device = self._params[0].device if self._params else None  # the thread makes it current
        self._thread = CommThread(f"DataParallel comm thread (rank {dist.get_rank()})", device) if threaded else None
        if self.world_size == 1:
            return  # the average over one rank is the gradient itself: nothing to do
        def expert(p) -> bool:
            return expert_group is not None and getattr(p, "ep_shard", None) is not None

        experts = {id(p) for p in module.parameters() if expert(p)}
        broadcast_tensors([p.data for p in module.parameters() if id(p) not in experts] + list(module.buffers()),
                          group, broadcast_from, int(bucket_mb * 2**20))
        if experts:
            broadcast_tensors([p.data for p in module.parameters() if id(p) in experts], expert_group, 0,
                              int(bucket_mb * 2**20))
        cap = max(int(bucket_mb * 2**20), 1)
        last = None if last_bucket_mb is None else max(int(last_bucket_mb * 2**20), 1)
        for i, params in enumerate(_assign_buckets(self._params, cap, kind=expert, last_bytes=last)):
            b = self._make_bucket(i, params)
            if expert(params[0]):
                b.group, b.reduce = expert_group, dist.get_world_size(expert_group) > 1
            else:
                b.group = group
            self._buckets.append(b)
        for b in self._buckets:
            for pos, p in enumerate(b.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(_weak_hook(self, b, pos)))
        tied = {id(w) for m in module.modules() if (w := getattr(m, "tied_weight", None)) is not None}
        self._late = {b.index for b in self._buckets if any(id(p) in tied for p in b.params)}
        self._reset()

    def __del__(self):
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.running:
            thread.abandon()

    @staticmethod
    def _make_bucket(index: int, params: list[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return _Bucket(index, params, buffer, views, buffer[offset:])

    def forward(self, *args, **kwargs):
        if self._buckets and self._in_backward:  # the previous backward pass died half-way
            self._reset()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate ``.grad`` locally, without communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def pipeline_step(self):
        """A pipeline step's backward passes: gradients accumulate locally (:meth:`no_sync`) until
        :meth:`reduce_gradients` after the flush (ZeRO's wrapper has its own) -- but for the buckets whose
        gradients a chunk's last backward completes (:meth:`final_backward`)."""
        return self.no_sync()

    @contextlib.contextmanager
    def final_backward(self):
        """Inside :meth:`pipeline_step`: the backward run inside is a chunk's last of the step (the executor's
        :func:`~shardwise.parallel.pipeline.executor.last_backward_actions`), so the gradients it completes are
        final. Each bucket is all-reduced as soon as all its gradients are in, in bucket order, beside the rest of
        the schedule -- Megatron-Core overlaps its data-parallel reduction with the pipeline's cool-down the same
        way -- and :meth:`reduce_gradients` after the flush launches the rest and waits. A bucket holding the tied
        table waits for the flush (its two copies add their gradients after it)."""
        self._final = not self._sync and bool(self._buckets)  # (a chunk's backward passes never nest)
        try:
            yield
        finally:
            self._final = False

    def reduce_gradients(self) -> None:
        """Average now the gradients accumulated under :meth:`no_sync` (a pipeline's, after its flush;
        Narayanan et al. 2021 §3): every bucket is launched at once, then waited for; each ``.grad`` is then a
        view of its bucket. A collective over the group."""
        if self._buckets:
            self._finish_backward()

    shard_group = None
    """Replicas hold whole, equal gradients: nothing is summed over the data-parallel group for a norm
    (a ZeRO wrapper names its shard group here; :mod:`shardwise.parallel.grad_norm`)."""

    def grad_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """``(p.grad, p)`` for each parameter with a gradient: what this rank holds of the gradient."""
        return [(p.grad, p) for p in self._params if p.grad is not None]

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of gradient elements in each bucket, in launch order."""
        return [b.buffer.numel() - len(b.params) for b in self._buckets]

    # ---- during backward ---------------------------------------------------------------------

    def _reset(self) -> None:
        if self._thread is not None and self._thread.running:  # a backward pass died half-way
            self._thread.abandon()
        self._in_backward = False
        self._launched_early = 0
        self._next_bucket = 0
        for b in self._buckets:
            b.pending, b.work = len(b.params), None
            b.ready = [False] * len(b.params)

    def _on_grad_ready(self, bucket: _Bucket, pos: int) -> None:
        """Post-accumulate-grad hook of parameter ``pos`` of ``bucket``: stage its gradient; launch every bucket
        that is complete, in order. (Called once per parameter per backward: kept to a few attribute reads.)"""
        if not self._sync:  # a pipeline step: only inside a chunk's last backward, and not the tied table's bucket
            if not self._final or bucket.index in self._late:
                return
        elif not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if bucket.ready[pos]:
            raise RuntimeError(
                "DataParallel: a parameter received its gradient twice in one backward pass (reentrant activation "
                "checkpointing?); use torch.utils.checkpoint with use_reentrant=False"
            )
        bucket.ready[pos] = True
        bucket.pending -= 1
        if torch.is_grad_enabled():  # backward(create_graph=True): the copy must not enter the graph
            with torch.no_grad():
                self._stage(bucket, pos)
        else:
            self._stage(bucket, pos)
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            b = buckets[self._next_bucket]
            b.flags.fill_(1)
            self._launch(b)
            self._launched_early += 1

    def _stage(self, bucket: _Bucket, pos: int) -> None:
        """Copy one parameter's gradient into its bucket, times 1 / group size in the same pass (as torch DDP's
        reducer does: a multiply, cheaper than a divide on the CPU, and the same number for a power-of-two group)."""
        grad, view = bucket.params[pos].grad, bucket.views[pos]
        if grad.data_ptr() == view.data_ptr():  # .grad is already this bucket view: scale in place
            view.mul_(self._scale)
        else:
            torch.mul(grad, self._scale, out=view)

    def _launch(self, bucket: _Bucket) -> None:
        if not bucket.reduce:
            bucket.work = None
        elif self._thread is None:
            bucket.work = self.all_reduce_fn(bucket.buffer, bucket.group)
        else:
            bucket.work = self._thread.submit(self.all_reduce_fn, bucket.buffer, bucket.group,
                                              label=f"all-reduce of bucket {bucket.index}")
        self._next_bucket = bucket.index + 1

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End-of-backward callback: reduce what is left, wait, and point each ``.grad`` at its average."""
        try:
            for b in self._buckets[self._next_bucket:]:
                for pos, p in enumerate(b.params):
                    if b.ready[pos]:
                        b.flags[pos] = 1
                    elif p.grad is not None:  # no gradient this pass, but one accumulated earlier
                        self._stage(b, pos)
                        b.flags[pos] = 1
                    else:  # no gradient at all on this rank: contribute zeros
                        b.views[pos].zero_()
                        b.flags[pos] = 0
                self._launch(b)
            if self._thread is not None:
                with self.comm_stats.waiting():
                    self._thread.join()  # re-raises a failure of the communication thread here
            for b in self._buckets:
                self.comm_stats.wait(b.work.result if isinstance(b.work, Job) else b.work)
                for pos, (p, view) in enumerate(zip(b.params, b.views, strict=True)):
                    if p.grad is None:
                        if b.flags[pos].item() != 0:  # another rank had a gradient: take the average
                            p.grad = view
                        # else no rank had one: leave None, as a single process would
                    elif p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
            self.comm_bytes_last_step = sum(b.buffer.numel() * b.buffer.element_size()
                                            for b in self._buckets if b.reduce)
            self.overlapped_buckets_last_step = self._launched_early
        finally:
            self._reset()
