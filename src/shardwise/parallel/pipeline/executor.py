"""Execute a schedule's action lists on the chunks one pipeline rank holds.

:class:`Pipeline` runs one training step (forward and backward of every micro-batch) by walking
this rank's action list from :func:`~shardwise.parallel.pipeline.schedules.build_schedule`:
the sends that follow a computation and the receives of the next computations are posted together in
one batch (:class:`~shardwise.parallel.pipeline.transfer.P2P`; receives one computation ahead, see
:func:`_plan`), a computation waits only for the receive it needs, and every forward/backward/send/receive/wait is
recorded in a :class:`~shardwise.parallel.pipeline.timeline.Timeline`. The loss of micro-batch ``i`` is
scaled by ``1/m`` before its backward, so the accumulated gradients equal those of the mean loss over
the whole batch (GPipe's synchronous micro-batch gradient accumulation, Huang et al. 2019 §2.2).
With tied embeddings the first and last stages' copies of the token table exchange and add their
gradients after the last backward (Shoeybi et al. 2019; Narayanan et al. 2021 §3).
Auxiliary losses of earlier stages (the routers' load-balancing and z-losses of mixture-of-experts blocks,
:mod:`shardwise.model.moe`): the single-process loss adds every block's, but only the last stage computes
the loss. A stage before it backpropagates its blocks' weighted auxiliary loss of micro-batch ``i`` together
with the gradient of its output (``backward([out, aux * scale / m], [grad, 1])``) -- its output carries the
auxiliary loss's gradient -- so the accumulated gradients are the single-process ones; the value is kept in
:attr:`Pipeline.aux_loss` for the logged loss (the schedule adds it over the stages).
Schedules with a split backward (``zb-h1``; Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §2-3)
run ``B`` with the chunks' linear layers deferring their weight gradients to a per-micro-batch
:class:`~shardwise.parallel.pipeline.zero_bubble.WeightGradStore`, and the ``W`` action computes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.clock import clock_for
from shardwise.dist.comm.counting import CommStats
from shardwise.model.moe import moe_aux_loss, moe_layers
from shardwise.parallel.pipeline.checks import check_schedule
from shardwise.parallel.pipeline.schedules import (
    COMM,
    RECV_B,
    RECV_F,
    SEND_F,
    Action,
    B,
    F,
    W,
    build_schedule,
)
from shardwise.parallel.pipeline.timeline import Recorder, Timeline
from shardwise.parallel.pipeline.transfer import P2P, message_tag
from shardwise.parallel.pipeline.zero_bubble import WeightGradStore, defer_linear_weight_grads


def split_microbatches(batch: torch.Tensor, n_microbatches: int) -> tuple[torch.Tensor, ...]:
    """``batch`` split along dim 0 into ``n_microbatches`` equal micro-batches."""
    if batch.shape[0] % n_microbatches:
        raise ValueError(f"a batch of {batch.shape[0]} sequences does not split into parallel.microbatches="
                         f"{n_microbatches} equal micro-batches; use a divisor of {batch.shape[0]}")
    return batch.chunk(n_microbatches)


class Pipeline:
    """One pipeline rank: its model chunks, the schedule, and the step that runs them.

    * ``chunks``: this rank's modules in chunk order (one, or ``v`` for ``"interleaved"``); chunk ``c``
      is global stage ``c * p + rank``. ``chunk(x, targets)`` takes the inputs (first stage) or the
      previous stage's activation and returns the next activation, or the scalar loss on the last stage.
    * ``stage_ranks``: global ranks of the ``p`` pipeline ranks of this replica, in stage order
      (``Mesh.ranks("pp")``); this process must be one of them.
    * ``schedule``: ``"naive"``, ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``;
      ``n_microbatches``: m. With ``"zb-h1"`` every ``nn.Linear`` of the chunks is made to defer its
      weight gradients to :attr:`weight_grads`
      (:func:`~shardwise.parallel.pipeline.zero_bubble.defer_linear_weight_grads`).
    * ``d_model`` / ``act_dtype``: an activation of a micro-batch of inputs ``[b, t]`` is
      ``[b, t / seq_shards, d_model]`` of ``act_dtype`` -- known on every rank, so nothing is exchanged but
      data. Activations and their gradients travel in ``act_dtype`` whatever dtype a stage computes in.
      ``seq_shards``: with sequence parallelism (Korthikanti et al. 2022 §4.2.2) a stage's output is this
      rank's ``t / tp`` tokens -- the residual stream between blocks is sequence-split -- so stages exchange
      1/tp of the whole-sequence bytes, as in Megatron.
    * ``forward_context``: a context-manager factory entered around every forward computation
      (e.g. ``torch.autocast`` for mixed precision; backward runs outside it, as torch recommends).
    * ``loss_scale``: None, or a factor (a number or a 0-dim tensor on the device) the last stage multiplies each
      micro-batch's ``loss / m`` by before backward (fp16 dynamic loss scaling, Micikevicius et al. 2018 §3.2);
      set it before every step.
    * ``comm_stats``: where every point-to-point send is recorded (:mod:`shardwise.dist.comm.counting`;
      activations, their gradients, the tied table's gradient).
    * ``tokens_to_every_stage``: every stage's forward also gets its micro-batch's input ids as ``tokens=``
      (every pipeline rank reads the same batch; bert's classifier derives its padding mask from them on each
      stage, so the mask goes along with the activations at no cost).

    With a ``dropout_key`` (:meth:`step`), the forward of micro-batch ``i`` gets it shifted to the
    micro-batch's first sequence (``dropout_key=``), on every stage: the masks are those one process draws.
    """

    def __init__(self, chunks: Sequence[nn.Module], stage_ranks: Sequence[int], schedule: str,
                 n_microbatches: int, d_model: int, act_dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 comm_stats: CommStats | None = None, seq_shards: int = 1, tokens_to_every_stage: bool = False):
        self.chunks = list(chunks)
        self.p, self.v, self.m = len(stage_ranks), len(self.chunks), n_microbatches
        check_schedule(schedule, self.p, n_microbatches, self.v)
        self.schedule = schedule
        self.comm_stats = comm_stats if comm_stats is not None else CommStats()
        self.comm = P2P(list(stage_ranks), self.v, group, stats=self.comm_stats)
        self.rank = self.comm.rank
        self.n_stages = self.p * self.v
        self.all_actions = build_schedule(schedule, self.p, n_microbatches, self.v)
        """Every pipeline rank's action list (a step is replayed on them: ``timeline.replayed_bubble``)."""
        self.actions = self.all_actions[self.rank]
        self.d_model, self.act_dtype, self.device = d_model, act_dtype, torch.device(device)
        self.seq_shards = seq_shards
        self._timeline: Timeline | None = Timeline(self.rank)
        self._recorder: Recorder | None = None
        self.clock = clock_for(self.device)
        self.plan = _plan(self.actions)
        self.split_backward = any(a.kind == W for a in self.actions)
        self.weight_grads = WeightGradStore()
        """Deferred weight gradients of ``B`` actions, computed by ``W`` actions (split-backward schedules)."""
        if self.split_backward:
            for chunk in self.chunks:
                defer_linear_weight_grads(chunk, self.weight_grads)
        self.forward_context = forward_context
        self.tokens_to_every_stage = tokens_to_every_stage
        self.loss_scale: torch.Tensor | float | None = None
        self.moe_chunks = {c for c, chunk in enumerate(self.chunks) if moe_layers(chunk)}
        """Chunks with mixture-of-experts blocks, whose router losses their backward adds."""
        self.aux_loss = torch.zeros((), dtype=torch.float64)
        """The last step's weighted auxiliary losses of this rank's stages before the last, mean over
        micro-batches (a part of the single-process loss the last stage does not see)."""

    def parameters(self):
        """Every parameter of this rank's chunks (tied copies appear on each stage holding one)."""
        for chunk in self.chunks:
            yield from chunk.parameters()

    def activation_shape(self, input_shape: Sequence[int]) -> tuple[int, int, int]:
        """What passes between stages for inputs ``[b, t]``: ``[b, t / seq_shards, d_model]``."""
        b, t = input_shape
        if t % self.seq_shards:
            raise ValueError(f"a sequence of {t} tokens does not split over {self.seq_shards} sequence-parallel ranks")
        return b, t // self.seq_shards, self.d_model

    def stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def _extras(self, tokens: torch.Tensor, dropout_key=None) -> dict:
        """The keyword arguments of a chunk's forward on a micro-batch of input ids ``tokens``."""
        out = {"tokens": tokens} if self.tokens_to_every_stage else {}
        return out if dropout_key is None else {**out, "dropout_key": dropout_key}

    @property
    def timeline(self) -> Timeline:
        """The last step's events, made from the stamps of :attr:`clock` on first use after the step (on a GPU
        that reads the device's clock, a wait: a training loop asks only on the steps that report it)."""
        if self._timeline is None:
            self._timeline = self._recorder.timeline()
        return self._timeline

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, dropout_key=None,
             final_backward: Callable[[], contextlib.AbstractContextManager] | None = None) -> torch.Tensor | None:
        """Forward and backward of the batch ``inputs``/``targets`` (``[B, T]``); gradients accumulate
        into the chunks' ``.grad``. Returns the mean loss on the rank holding the last stage, else None.
        Every rank passes batches of the same shape; only the first stage reads ``inputs`` and only the
        last reads ``targets``. ``dropout_key``: that of the batch's first sequence. ``final_backward``: a
        context entered around each chunk's last backward of the step (:func:`last_backward_actions`), where
        its gradients become final (a data-parallel wrapper may start reducing them there)."""
        finals = last_backward_actions(self.actions) if final_backward is not None else set()
        x_mbs = split_microbatches(inputs, self.m)
        y_mbs = split_microbatches(targets, self.m)
        act_shape = self.activation_shape(x_mbs[0].shape)
        tl = Recorder(self.rank, self.clock)
        tl.start = tl.now()
        self.weight_grads.clear()
        saved_in: dict[tuple[int, int], torch.Tensor] = {}
        saved_out: dict[tuple[int, int], torch.Tensor] = {}
        recvs: dict[tuple[str, int, int], tuple[torch.Tensor, dist.Work]] = {}
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        pending: list = []
        losses: list[torch.Tensor] = []
        saved_aux: dict[tuple[int, int], torch.Tensor] = {}
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        live = 0

        def flush() -> None:
            if not pending:
                return
            ops = []
            for a in pending:
                key = (a.chunk, a.mb)
                if a.kind == SEND_F:
                    tensor = saved_out[key].detach().to(self.act_dtype)
                elif a.kind == RECV_F or a.kind == RECV_B:
                    tensor = torch.empty(act_shape, dtype=self.act_dtype, device=self.device)
                else:  # SEND_B: the gradient of this stage's input
                    tensor = saved_in.pop(key).grad.to(self.act_dtype)
                ops.append((a, tensor))
            t0 = tl.now()
            works = self.comm.post(ops)
            t1 = tl.now()
            if len(works) != len(ops):  # a coalescing backend returns one handle for the batch
                works = [works[-1]] * len(ops)
            for (a, tensor), work in zip(ops, works, strict=True):
                kind = "send" if a.kind.startswith("send") else "recv"
                tl.add(kind, self.stage(a.chunk), a.mb, t0, t1)
                if kind == "send":
                    sends.append((work, tensor))
                else:
                    recvs[(a.kind, a.chunk, a.mb)] = (tensor, work)
            pending.clear()

        def received(kind: str, chunk: int, mb: int) -> torch.Tensor:
            tensor, work = recvs.pop((kind, chunk, mb))
            with tl.record("wait", self.stage(chunk), mb), self.comm_stats.waiting():
                work.wait()
            return tensor

        for a, recvs_now, sends_after in self.plan:
            pending.extend(recvs_now)
            flush()
            c, i, s = a.chunk, a.mb, self.stage(a.chunk)
            last = s == self.n_stages - 1
            if a.kind == F:
                x = x_mbs[i] if s == 0 else received(RECV_F, c, i).requires_grad_()
                key = None if dropout_key is None else dropout_key.shifted(i * len(x_mbs[0]))
                with tl.record(F, s, i), self.forward_context():
                    out = self.chunks[c](x, y_mbs[i] if last else None, **self._extras(x_mbs[i], key))
                if last:
                    losses.append(out.detach().float())
                    out = out / self.m
                    if self.loss_scale is not None:
                        out = out * self.loss_scale
                elif c in self.moe_chunks and (aux := moe_aux_loss(self.chunks[c])) is not None and aux.requires_grad:
                    aux_sum += aux.detach().double()
                    scale = 1.0 if self.loss_scale is None else self.loss_scale
                    saved_aux[(c, i)] = aux * (scale / self.m)
                if s > 0:
                    saved_in[(c, i)] = x
                saved_out[(c, i)] = out
                live += 1
                tl.peak_live = max(tl.peak_live, live)
            elif a.kind == B:
                grad = None if last else received(RECV_B, c, i)
                out = saved_out.pop((c, i))
                defer = self.weight_grads.deferring((c, i)) if self.split_backward else contextlib.nullcontext()
                aux = saved_aux.pop((c, i), None)
                final = final_backward() if a in finals else contextlib.nullcontext()
                with tl.record(B, s, i), defer, final:
                    if aux is None:
                        torch.autograd.backward(out, None if grad is None else grad.to(out.dtype))
                    else:  # the stage's output carries its auxiliary loss's gradient
                        torch.autograd.backward([out, aux], [grad.to(out.dtype), torch.ones_like(aux)])
                if not self.split_backward:
                    live -= 1
            elif a.kind == W:
                with tl.record(W, s, i):
                    self.weight_grads.run((c, i))
                live -= 1  # the saved inputs of the weight gradients are released only now
            pending.extend(sends_after)  # posted with the next batch, right after this computation
        flush()
        with tl.record("wait", -1, -1), self.comm_stats.waiting():
            for work, _ in sends:
                work.wait()
        self._sync_tied_grads(tl)
        self.aux_loss = aux_sum / self.m
        tl.end = tl.now()
        self._recorder, self._timeline = tl, None  # the device's stamps are read when the timeline is asked for
        if losses:
            return torch.stack(losses).mean()
        return None

    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The loss of ``inputs``/``targets`` without gradients (validation): the whole batch passes
        the stages in order, one at a time. Returns the loss on the rank holding the last stage, else None."""
        act_shape = self.activation_shape(inputs.shape)
        x: torch.Tensor | None = None
        for s in range(self.n_stages):
            owner, chunk = s % self.p, s // self.p
            if owner != self.rank:
                continue
            if s > 0 and (s - 1) % self.p != self.rank:  # the previous stage lives on another rank
                x = torch.empty(act_shape, dtype=self.act_dtype, device=self.device)
                self.comm.exchange([], [(x, self.comm.stage_ranks[(s - 1) % self.p],
                                         message_tag(RECV_F, s, self.m + 2, self.n_stages))], count=False)
            last = s == self.n_stages - 1
            with self.forward_context():
                out = self.chunks[chunk](inputs if s == 0 else x, targets if last else None, **self._extras(inputs))
            if last:
                return out.float()
            x = out.to(self.act_dtype)
            if (s + 1) % self.p != self.rank:
                self.comm.exchange([(x, self.comm.stage_ranks[(s + 1) % self.p],
                                     message_tag(SEND_F, s + 1, self.m + 2, self.n_stages))], [], count=False)
        return None

    def _sync_tied_grads(self, tl: Recorder) -> None:
        """Add the gradients of the two copies of a tied weight (first stage, last stage)."""
        tied = [(c, w) for c, chunk in enumerate(self.chunks) if (w := getattr(chunk, "tied_weight", None)) is not None]
        if not tied:
            return
        if len(tied) == 2:  # both copies on this rank (p == 1, several chunks)
            g = tied[0][1].grad + tied[1][1].grad
            for _, w in tied:
                w.grad.copy_(g)
            return
        (c, w), = tied
        peer = self.p - 1 if self.stage(c) == 0 else 0
        if peer == self.rank:
            return
        other = torch.empty_like(w.grad)
        tag = message_tag("tied", 0, self.m + 1, self.n_stages)
        with tl.record("wait", self.stage(c), -1):
            peer_rank = self.comm.stage_ranks[peer]
            self.comm.exchange([(w.grad, peer_rank, tag)], [(other, peer_rank, tag)])
        w.grad.add_(other)


def last_backward_actions(actions: list[Action]) -> set[Action]:
    """Each chunk's last backward action in one rank's list: after it the chunk's gradients are final. Empty for
    a schedule that splits the backward (``W`` accumulates weight gradients outside autograd, and
    :meth:`Pipeline._sync_tied_grads` runs after every action). The simulator reads the same set."""
    if any(a.kind == W for a in actions):
        return set()
    last: dict[int, Action] = {}
    for a in actions:
        if a.kind == B:
            last[a.chunk] = a
    return set(last.values())


def _plan(actions: list[Action]) -> list[tuple[Action, list[Action], list[Action]]]:
    """``(computation, receives to post before it, sends to post after it)`` for each computation.

    Receives are posted one computation ahead (prefetch): those of computation ``n + 1`` go out
    with those of ``n``, so a message travels while this rank computes ``n``. Every message has its own
    tag, so posting early never mismatches."""
    computes = [k for k, a in enumerate(actions) if a.kind not in COMM]
    recvs: list[list[Action]] = [[] for _ in computes]
    sends: list[list[Action]] = [[] for _ in computes]
    n = -1
    for a in actions:
        if a.kind not in COMM:
            n += 1
        elif a.kind in (RECV_F, RECV_B):
            recvs[n + 1].append(a)  # with_comm puts receives right before their computation
        else:
            sends[n].append(a)  # ... and sends right after it
    out = []
    for n, k in enumerate(computes):
        now = (recvs[0] if n == 0 else []) + (recvs[n + 1] if n + 1 < len(computes) else [])
        out.append((actions[k], now, sends[n]))
    return out
