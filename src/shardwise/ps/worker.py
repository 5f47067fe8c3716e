"""A parameter-server worker: pull the weights, compute a gradient on its data shard, push it.

Each step at clock c (Li et al. OSDI 2014 §3; BytePS's worker, Jiang et al. OSDI 2020 §4): *pull* every
partition from its server (answered when :mod:`shardwise.ps.consistency` allows), run forward and backward
on the worker's micro-batches, and *push* each partition's gradient as soon as backward produced it --
from a gradient hook, in the order :mod:`shardwise.ps.scheduling` chooses -- then tell every server the
clock is complete (END). Compression of pushes: :class:`shardwise.ps.protocol.PushCodec`.

Replies arrive in the forward order (:func:`shardwise.ps.partition.forward_order`). With ``priority``
scheduling the worker also does not wait for the whole reply before computing (P3, Jayarajan et al. SysML
2019 §3, "parameter slicing and priority-based propagation"): the forward pass starts once every server
answered, and a forward pre-hook on each module waits only for its own parameters' partitions, so the
later layers' weights arrive while the first layers compute. ``fifo`` waits for every partition first.

Everything sent is counted from the tensors handed to ``isend`` (:mod:`shardwise.dist.comm.counting`);
pulled bytes from the tensors received. Every wait is bounded by ``timeout_s`` and names the server.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist.comm.counting import CommLedger, nbytes
from shardwise.model.dropout import DropoutKey
from shardwise.parallel.grad_norm import clip_grad_norm, parameter_pieces
from shardwise.ps import protocol
from shardwise.ps.partition import Partition, forward_order
from shardwise.ps.scheduling import PushScheduler
from shardwise.train.precision import autocast_context


class Worker:
    """One worker rank over ``model`` (its replica); ``partitions``: every partition, with its server rank."""

    def __init__(self, model: nn.Module, partitions: list[Partition], codec: protocol.PushCodec, policy: str,
                 credit_bytes: int, timeout_s: float, delay_s: float = 0.0):
        self.model, self.codec, self.timeout_s, self.delay_s = model, codec, timeout_s, delay_s
        self.rank = dist.get_rank()
        self.parts = sorted(partitions, key=lambda q: q.key)
        self.by_server: dict[int, list[Partition]] = defaultdict(list)
        by_name: dict[str, list[Partition]] = defaultdict(list)
        for q in forward_order(self.parts):  # the order of a server's reply
            self.by_server[q.server].append(q)
            by_name[q.name].append(q)
        self.servers = sorted(self.by_server)
        self.params = dict(model.named_parameters())
        self.ledger = CommLedger()
        self.scheduler = PushScheduler(policy, credit_bytes, self._send_push, timeout_s)
        self.clock = 0
        self._pushing = False
        self._keep: list[torch.Tensor] = []
        self.pulled: int | None = None
        """The clock whose weights the model holds (None: not pulled yet)."""
        self.staleness = {"last": 0, "max": 0, "sum": 0, "pulls": 0}
        """The observed staleness of this run's pulls: the latest, the largest, their sum and count."""
        self.wait_s = self.bytes_pulled = self.tail_s = 0.0
        self.server_info: dict[int, list[float]] = {}
        self.lazy_pulls = policy == "priority"
        self._pending: dict[int, list[tuple]] = {}
        """id(parameter) -> the receives of its partitions not waited for yet (priority pulls)."""
        self.pull_timing = {"requested": 0.0, "forward": 0.0, "last": 0.0, "lazy_waits": 0}
        for name, p in self.params.items():
            if name in by_name:
                p.register_post_accumulate_grad_hook(self._hook(by_name[name]))
        if self.lazy_pulls:
            pulled = {id(self.params[q.name]) for q in self.parts}
            for module in model.modules():
                if any(id(p) in pulled for p in module.parameters(recurse=False)):
                    module.register_forward_pre_hook(self._await_params)

    # ---- pull -----------------------------------------------------------------------------------

    @torch.no_grad()
    def pull(self, clock: int, final: bool = False, lazy: bool = False) -> None:
        """Load the servers' weights for ``clock`` into the model (blocks as the consistency rule says).
        ``lazy``: return once every server answered; each partition is waited for by the forward pre-hook
        of the module that uses it (:meth:`_await_params`), or by :meth:`finish_pull`."""
        if self.pulled == clock and not final:
            return
        self.finish_pull()
        t0 = time.perf_counter()
        recvs = []
        for s in self.servers:  # receives first: the server's reply never waits for them
            info = torch.empty(protocol.INFO, dtype=torch.float64)
            info_work = dist.irecv(info, src=s, tag=protocol.REPLY)
            # straight into the parameters' slices (contiguous runs of the flattened tensors; fp32)
            parts = [(q, self.params[q.name].view(-1)[q.start:q.start + q.numel]) for q in self.by_server[s]]
            works = [(q, buf, dist.irecv(buf, src=s, tag=protocol.REPLY)) for q, buf in parts]
            recvs.append((s, info, info_work, works))
        for s in self.servers:
            hdr = protocol.header(protocol.PULL, clock, float(final))
            self._count(hdr)
            protocol.wait(dist.isend(hdr, dst=s, tag=protocol.HEADER), self.timeout_s, self._who(s, "pull request"))
        stale = 0
        for s, info, info_work, parts in recvs:
            protocol.wait(info_work, self.timeout_s, self._who(s, f"the answer to the pull of clock {clock}"))
            self.server_info[s] = info.tolist()
            stale = max(stale, int(info[3]))
            self.bytes_pulled += nbytes(info) + sum(nbytes(buf) for _, buf, _ in parts)
            for q, _, work in parts:
                what = self._who(s, f"weights of key {q.key} for clock {clock}")
                self._pending.setdefault(id(self.params[q.name]), []).append((work, what))
        self.pull_timing.update(requested=t0, forward=0.0, last=0.0)
        if not lazy:
            self.finish_pull()
        self.wait_s += time.perf_counter() - t0
        if not final:
            st = self.staleness
            st.update(last=stale, max=max(st["max"], stale), sum=st["sum"] + stale, pulls=st["pulls"] + 1)
        self.pulled = clock

    def finish_pull(self) -> None:
        """Wait for every partition of the last pull not waited for yet."""
        t0 = time.perf_counter()
        for works in self._pending.values():
            for work, what in works:
                protocol.wait(work, self.timeout_s, what)
        if self._pending:
            self.pull_timing["last"] = time.perf_counter()
            self.wait_s += self.pull_timing["last"] - t0
        self._pending.clear()

    def _await_params(self, module: nn.Module, args) -> None:
        """Forward pre-hook (priority pulls): wait for the partitions of this module's own parameters."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        if not self.pull_timing["forward"]:
            self.pull_timing["forward"] = t0
        waited = False
        for p in module.parameters(recurse=False):
            for work, what in self._pending.pop(id(p), ()):
                protocol.wait(work, self.timeout_s, what)
                self.pull_timing["lazy_waits"] += 1
                waited = True
        if waited:
            self.pull_timing["last"] = time.perf_counter()
            self.wait_s += self.pull_timing["last"] - t0

    def pull_overlap_frac(self) -> float:
        """The share of the last pull's span (request sent to last partition in) after the forward began."""
        t = self.pull_timing
        if not t["forward"] or t["last"] <= t["requested"]:
            return 0.0
        return min(1.0, max(0.0, t["last"] - t["forward"]) / (t["last"] - t["requested"]))

    # ---- compute and push -----------------------------------------------------------------------

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str, asp: bool,
             dropout_key: DropoutKey | None = None) -> tuple[float, float]:
        """One clock: pull, forward/backward on ``batches`` with pushes from gradient hooks, END to every
        server. Returns (mean loss, this worker's gradient norm). ``dropout_key``: that of the first micro-batch
        (its place in the step's global batch), shifted by the sequences before each, as the engine's schedules
        do, so the workers draw the masks one process draws."""
        self.pull(self.clock, lazy=self.lazy_pulls)
        if self.delay_s:
            time.sleep(self.delay_s)  # an injected straggler
        device = next(self.model.parameters()).device
        loss_sum = torch.zeros((), device=device)
        done = 0
        for i, (x, y) in enumerate(batches):
            self._pushing = i == len(batches) - 1
            with autocast_context(precision, device.type):
                if dropout_key is None:
                    loss = self.model(x, y)
                else:
                    loss = self.model(x, y, dropout_key=dropout_key.shifted(done))
            done += x.shape[0]
            loss_sum += loss.detach()
            self.finish_pull()  # a partition no module claimed (none today): in before its gradient
            (loss / len(batches)).backward()
        self._pushing = False
        self.tail_s = self.scheduler.flush()
        norm = clip_grad_norm(parameter_pieces(self.model.parameters()), 0.0, device=device)
        for s in self.servers:  # asp clips each push by its worker's norm; bsp / ssp by the mean's
            hdr = protocol.header(protocol.END, self.clock, 0.0, norm * norm if asp else 0.0)
            self._count(hdr)
            protocol.wait(dist.isend(hdr, dst=s, tag=protocol.HEADER), self.timeout_s, self._who(s, "end of clock"))
        self._keep.clear()
        self.model.zero_grad(set_to_none=True)
        self.clock += 1
        return float(loss_sum) / len(batches), norm

    def _hook(self, parts: list[Partition]):
        def hook(p: torch.Tensor) -> None:
            if not self._pushing:
                return
            flat = p.grad.detach().reshape(-1)
            for q in parts:
                payload = self.codec.encode(q.key, flat[q.start:q.start + q.numel])
                self.scheduler.ready(q.priority, q.key, nbytes(payload), (q, payload))
        return hook

    def _send_push(self, item) -> list:
        q, payload = item
        hdr = protocol.header(protocol.PUSH, self.clock, q.key)
        self._keep += [hdr, payload]
        what = self._who(q.server, f"push of key {q.key}")
        out = []
        for t, tag in ((hdr, protocol.HEADER), (payload, protocol.DATA)):
            self._count(t)
            out.append((dist.isend(t, dst=q.server, tag=tag), nbytes(t), what))
        return out

    # ---- control messages -----------------------------------------------------------------------

    def control(self, kind: int, clock: int) -> None:
        """Send CKPT or STOP to every server."""
        for s in self.servers:
            hdr = protocol.header(kind, clock)
            self._count(hdr)
            protocol.wait(dist.isend(hdr, dst=s, tag=protocol.HEADER), self.timeout_s, self._who(s, "request"))

    def _count(self, t: torch.Tensor) -> None:
        stats = self.ledger["ps"]
        stats.hand(nbytes(t), backend=False)
        stats.send(nbytes(t))

    def _who(self, server: int, what: str) -> str:
        return f"ps worker rank {self.rank}: {what} to/from server rank {server}"

    def pop_metrics(self) -> dict[str, float]:
        """This step's measurements (the counters restart)."""
        comm = self.ledger.pop_metrics()
        st = self.staleness
        out = {
            "ps_clock": float(self.clock), "ps_staleness": float(st["last"]), "ps_staleness_max": float(st["max"]),
            "ps_staleness_mean": st["sum"] / st["pulls"] if st["pulls"] else 0.0,
            "ps_wait_s": self.wait_s, "ps_bytes_pushed": comm.get("ps_sent_bytes", 0.0),
            "ps_bytes_pulled": float(self.bytes_pulled), "ps_push_tail_s": self.tail_s,
            **comm, **self.scheduler.pop_metrics(),
        }
        if self.lazy_pulls:
            out["ps_pull_overlap_frac"] = self.pull_overlap_frac()
            out["ps_pull_lazy_waits"] = float(self.pull_timing["lazy_waits"])
            self.pull_timing["lazy_waits"] = 0
        for i, s in enumerate(self.servers):
            if s in self.server_info:
                out[f"ps_server{i}_updates"] = self.server_info[s][1]
        if self.server_info:  # bsp / ssp: the global batch's norm of the newest clock in this step's weights
            out["ps_update_grad_norm"] = self.server_info[self.servers[0]][4]
        self.wait_s = self.bytes_pulled = 0.0
        return out
