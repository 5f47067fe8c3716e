"""A parameter server: holds a key range of partitions, applies pushes with AdamW, answers pulls.

The server owns the fp32 values and AdamW moments of its partitions (Li et al. OSDI 2014 §3: servers keep
the globally shared parameters, each a key range; workers push gradients and pull weights). It applies
updates with torch's AdamW over its partitions -- element-wise, so partitioned steps equal the
whole-tensor step -- with the run's learning-rate schedule (:func:`shardwise.train.optim.lr_at` of the
clock), weight decay on matrices only, and global-norm clipping (the norm summed over every server's
partitions with a reduction over the servers' group, as ZeRO shards do, :mod:`shardwise.parallel.grad_norm`).
When pushes are applied and pulls answered is :mod:`shardwise.ps.consistency`'s rule.

It serves every worker from one loop over an inbox that one listening thread per worker fills with that
worker's requests in order (no socket of its own: torch.distributed receives). No wait is unbounded:
silence longer than ``timeout_s`` from the live workers, or a worker whose connection breaks, is an
error naming the ranks.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import TrainConfig
from shardwise.dist.comm.counting import nbytes
from shardwise.parallel.grad_norm import clip_grad_norm
from shardwise.ps import consistency, protocol
from shardwise.ps.partition import Partition, forward_order
from shardwise.train.optim import lr_at, set_lr
from shardwise.train.sharded import Piece


class Server:
    """One server rank. ``partitions``: the ones it owns; ``initial``: the full initial value of each
    tensor (by name), from which its partitions are cut; ``workers``: the worker ranks."""

    def __init__(self, partitions: list[Partition], initial: Mapping[str, torch.Tensor], workers: list[int],
                 tcfg: TrainConfig, mode: str, staleness: int, codec: protocol.PushCodec,
                 group: dist.ProcessGroup | None, timeout_s: float, start_clock: int = 0):
        self.parts = {q.key: q for q in sorted(partitions, key=lambda q: q.key)}
        self.rank, self.workers, self.tcfg = dist.get_rank(), list(workers), tcfg
        self.mode, self.staleness, self.codec, self.group = mode, staleness, codec, group
        self.timeout_s = timeout_s
        self.reply_order = [q.key for q in forward_order(partitions)]
        self.params = {k: nn.Parameter(initial[q.name].detach().reshape(-1)[q.start:q.start + q.numel].float().clone())
                       for k, q in self.parts.items()}
        groups = [{"params": [self.params[k] for k, q in self.parts.items() if q.decay == d],
                   "weight_decay": tcfg.weight_decay if d else 0.0} for d in (True, False)]
        groups = [g for g in groups if g["params"]]
        self.optimizer = torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                                           foreach=True) if groups else None
        self.applied = start_clock
        """Complete clocks: every worker's pushes of clocks < applied are in the parameters."""
        self.pushes_applied = {w: start_clock for w in self.workers}
        self.updates = 0
        """Optimizer steps this server took (bsp/ssp: one per clock; asp: one per push)."""
        self.pushes_received = 0
        self.bytes_received = self.bytes_sent = 0
        self.max_staleness_served = 0
        self.last_norm = 0.0
        """Global gradient norm (before clipping) of the newest update applied."""
        self._grads: dict = defaultdict(dict)  # (clock, worker) -> {key: gradient}
        self._ended: dict[int, set[int]] = defaultdict(set)
        self._pulls: list[tuple[int, int, bool]] = []
        self.on_checkpoint: Callable[[int], None] | None = None
        """Called with the step once every worker asked for a checkpoint (a collective with them)."""

    # ---- the loop -------------------------------------------------------------------------------

    def serve(self) -> None:
        """Serve until every worker sent STOP and every pull is answered, one request at a time in the
        order they arrive; waiting longer than ``timeout_s`` for the next one is an error naming the ranks."""
        inbox: queue.Queue = queue.Queue()
        for w in self.workers:
            threading.Thread(target=self._listen, args=(w, inbox), name=f"ps-listen-{w}", daemon=True).start()
        active, ckpt = set(self.workers), {}
        while active or self._pulls:
            try:
                w, kind, clock, a, b, payload = inbox.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ps server rank {self.rank}: a request from worker rank(s) "
                                   f"{self._awaited(active, ckpt)} (a worker died or hangs): no answer within "
                                   f"{self.timeout_s:g} s") from None
            if kind == protocol.STOP:
                active.discard(w)
            elif kind == protocol.PUSH:
                self._push(w, clock, int(a), payload)
            elif kind == protocol.END:
                self._end(w, clock, b)
            elif kind == protocol.PULL:
                self._pulls.append((w, clock, bool(a)))
            elif kind == protocol.CKPT:
                ckpt[w] = clock
            elif kind == protocol.FAILED:
                raise RuntimeError(f"ps server rank {self.rank}: the connection to worker rank {w} broke: {payload}")
            else:
                raise RuntimeError(f"ps server rank {self.rank}: unknown request {kind} from worker rank {w}")
            self._answer_pulls()
            if len(ckpt) == len(self.workers):
                (step,) = set(ckpt.values())
                if self.on_checkpoint is not None:
                    self.on_checkpoint(step)
                ckpt.clear()

    def _listen(self, w: int, inbox: queue.Queue) -> None:
        """One thread per worker: receive its requests in order (a push with its payload) into ``inbox``.
        gloo reports a receive's completion only to ``wait()``, and a receive from any source can miss a
        message under load, so each worker has a receive of its own; a broken connection is passed on."""
        hdr = torch.empty(4, dtype=torch.float64)
        while True:
            try:
                dist.irecv(hdr, src=w, tag=protocol.HEADER).wait()
                kind, clock, a, b = hdr.tolist()
                kind, clock, payload = int(kind), int(clock), None
                if kind == protocol.PUSH:
                    q = self.parts.get(int(a))
                    if q is None:
                        raise RuntimeError(f"worker rank {w} pushed key {int(a)}, which this server does not own")
                    payload = self.codec.payload(q.numel)
                    dist.irecv(payload, src=w, tag=protocol.DATA).wait()
            except Exception as e:  # noqa: BLE001 - handed to the serving loop, which names the worker
                inbox.put((w, protocol.FAILED, -1, 0.0, 0.0, str(e).splitlines()[0] if str(e) else repr(e)))
                return
            inbox.put((w, kind, clock, a, b, payload))
            if kind == protocol.STOP:
                return

    def _awaited(self, active: set[int], ckpt: dict) -> str:
        """The workers this server is waiting for: with bsp / ssp, those that have not ended a clock others
        ended, else every live one not paused for a checkpoint."""
        ended = self._ended.get(self.applied, set())
        late = [w for w in self.workers if w not in ended]
        if ended and consistency.aggregates(self.mode):
            return f"{late} (clock {self.applied} incomplete)"
        return str(sorted(set(active) - set(ckpt)))

    def _who(self, w: int, what: str) -> str:
        return f"ps server rank {self.rank}: {what} from worker rank {w}"

    # ---- pushes ---------------------------------------------------------------------------------

    def _push(self, w: int, clock: int, key: int, payload: torch.Tensor) -> None:
        self.bytes_received += nbytes(payload)
        self.pushes_received += 1
        self._grads[(clock, w)][key] = self.codec.decode(payload, self.parts[key].numel)

    def _end(self, w: int, clock: int, sq: float) -> None:
        got = self._grads.get((clock, w), {})
        if len(got) != len(self.parts):
            raise RuntimeError(f"ps server rank {self.rank}: worker rank {w} ended clock {clock} with "
                               f"{len(got)} of {len(self.parts)} partitions pushed")
        if not consistency.aggregates(self.mode):
            self._step({k: g for k, g in self._grads.pop((clock, w), {}).items()}, clock, math.sqrt(max(sq, 0.0)))
            self.pushes_applied[w] = clock + 1
            self.applied = min(self.pushes_applied.values())
            return
        self._ended[clock].add(w)
        while len(self._ended.get(self.applied, ())) == len(self.workers):  # clocks complete, in order
            c = self.applied
            grads = {}
            for key in self.parts:  # the mean over workers, summed in rank order (deterministic)
                total = torch.zeros(self.parts[key].numel)
                for worker in self.workers:
                    total.add_(self._grads[(c, worker)][key])
                grads[key] = total.div_(len(self.workers))
            for worker in self.workers:
                self._grads.pop((c, worker), None)
            del self._ended[c]
            self._step(grads, c, None)
            self.applied = c + 1
            for worker in self.workers:
                self.pushes_applied[worker] = c + 1

    @torch.no_grad()
    def _step(self, grads: dict[int, torch.Tensor], clock: int, norm: float | None) -> None:
        """One AdamW step on this server's partitions with ``grads``. ``norm``: the global gradient norm when
        known (asp: the pushing worker's); None: summed over the servers here (bsp / ssp, in clock order)."""
        for key, p in self.params.items():
            p.grad = grads[key]
        clip = self.tcfg.grad_clip
        if norm is None:
            pieces = [(p.grad, p) for p in self.params.values()]
            self.last_norm = clip_grad_norm(pieces, clip, shard_group=self.group, device=torch.device("cpu"))
        else:
            self.last_norm = norm
        if norm is not None and clip > 0:
            coef = min(1.0, clip / (norm + 1e-6))
            for p in self.params.values():
                p.grad.mul_(coef)
        if self.optimizer is not None:
            set_lr(self.optimizer, lr_at(clock, self.tcfg))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1

    # ---- pulls ----------------------------------------------------------------------------------

    def _answer_pulls(self) -> None:
        """Answer every pull the consistency rule now allows (the worker posted its receives first)."""
        waiting = []
        for w, clock, final in self._pulls:
            if not consistency.pull_ready(self.mode, clock, self.applied, self.staleness, final):
                waiting.append((w, clock, final))
                continue
            stale = consistency.staleness_of(clock, self.applied)
            self.max_staleness_served = max(self.max_staleness_served, stale)
            info = torch.tensor([self.applied, self.updates, self.pushes_received, stale, self.last_norm],
                                dtype=torch.float64)
            # in the forward order, sent and waited for before any step
            reply = [info] + [self.params[k].detach() for k in self.reply_order]
            works = [dist.isend(t, dst=w, tag=protocol.REPLY) for t in reply]
            for work in works:
                protocol.wait(work, self.timeout_s, f"ps server rank {self.rank}: the reply to worker rank {w}'s pull")
            self.bytes_sent += sum(nbytes(t) for t in reply)
        self._pulls = waiting

    # ---- checkpoints ----------------------------------------------------------------------------

    def checkpoint_pieces(self, aliases: Mapping[str, list[str]]) -> list[Piece]:
        """This server's pieces of the single-process state: its partitions of every parameter (under each
        name a tied parameter has in the state dict) and of AdamW's moments (optimizer index order); the
        step count from the partition that starts each tensor."""
        pieces = []
        for key, p in self.params.items():
            q = self.parts[key]
            for name in aliases[q.name]:
                pieces.append(Piece(f"model/{name}", p.detach(), q.start, q.shape))
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            for field, value in state.items():
                if value.dim() == 0:
                    if q.start == 0:
                        pieces.append(Piece(f"optim/{q.index}/{field}", value.reshape(-1), 0, ()))
                else:
                    pieces.append(Piece(f"optim/{q.index}/{field}", value.detach(), q.start, q.shape))
        return pieces

    @torch.no_grad()
    def load(self, model_state, optimizer_state: Mapping) -> None:
        """Take this server's partitions of a single-process checkpoint (any layout wrote it)."""
        for key, p in self.params.items():
            q = self.parts[key]
            p.copy_(model_state.read_slice(q.name, q.start, q.start + q.numel))
            per_param = optimizer_state["state"].get(q.index)
            if per_param is None or self.optimizer is None:
                continue
            state = {}
            for field in per_param:
                if per_param.ndim(field) == 0:
                    state[field] = per_param[field].clone()
                else:
                    state[field] = per_param.read_slice(field, q.start, q.start + q.numel).clone()
            self.optimizer.state[p] = state

    def stats(self) -> dict[str, float]:
        return {"updates": self.updates, "pushes_received": self.pushes_received, "applied_clocks": self.applied,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
                "max_staleness_served": self.max_staleness_served, "partitions": len(self.parts)}
