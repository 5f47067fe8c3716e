"""A parameter-server worker: pull the weights, compute a gradient on its data shard, push it.

Each step at clock c (Li et al. OSDI 2014 §3; BytePS's worker, Jiang et al. OSDI 2020 §4): *pull* every
partition from its server (answered when :mod:`shardwise.ps.consistency` allows), run forward and backward
on the worker's micro-batches, and *push* each partition's gradient as soon as backward produced it --
from a gradient hook, in the order :mod:`shardwise.ps.scheduling` chooses -- then tell every server the
clock is complete (END). Compression of pushes: :class:`shardwise.ps.protocol.PushCodec`.

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
from shardwise.parallel.grad_norm import clip_grad_norm, parameter_pieces
from shardwise.ps import protocol
from shardwise.ps.partition import Partition
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
        for q in self.parts:
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
        for name, p in self.params.items():
            if name in by_name:
                p.register_post_accumulate_grad_hook(self._hook(by_name[name]))

    # ---- pull -----------------------------------------------------------------------------------

    @torch.no_grad()
    def pull(self, clock: int, final: bool = False) -> None:
        """Load the servers' weights for ``clock`` into the model (blocks as the consistency rule says)."""
        if self.pulled == clock and not final:
            return
        t0 = time.perf_counter()
        recvs = []
        for s in self.servers:  # receives first: the server's reply never waits for them
            info = torch.empty(protocol.INFO, dtype=torch.float64)
            # straight into the parameters' slices (contiguous runs of the flattened tensors; fp32)
            bufs = [self.params[q.name].view(-1)[q.start:q.start + q.numel] for q in self.by_server[s]]
            recvs.append((s, info, bufs, [dist.irecv(t, src=s, tag=protocol.REPLY) for t in [info, *bufs]]))
        for s in self.servers:
            hdr = protocol.header(protocol.PULL, clock, float(final))
            self._count(hdr)
            protocol.wait(dist.isend(hdr, dst=s, tag=protocol.HEADER), self.timeout_s, self._who(s, "pull request"))
        stale = 0
        for s, info, bufs, works in recvs:
            for work in works:
                protocol.wait(work, self.timeout_s, self._who(s, f"weights for clock {clock}"))
            self.bytes_pulled += sum(nbytes(t) for t in [info, *bufs])
            self.server_info[s] = info.tolist()
            stale = max(stale, int(info[3]))
        self.wait_s += time.perf_counter() - t0
        if not final:
            st = self.staleness
            st.update(last=stale, max=max(st["max"], stale), sum=st["sum"] + stale, pulls=st["pulls"] + 1)
        self.pulled = clock

    # ---- compute and push -----------------------------------------------------------------------

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str, asp: bool) -> tuple[float, float]:
        """One clock: pull, forward/backward on ``batches`` with pushes from gradient hooks, END to every
        server. Returns (mean loss, this worker's gradient norm)."""
        self.pull(self.clock)
        if self.delay_s:
            time.sleep(self.delay_s)  # an injected straggler
        device = next(self.model.parameters()).device
        loss_sum = torch.zeros((), device=device)
        for i, (x, y) in enumerate(batches):
            self._pushing = i == len(batches) - 1
            with autocast_context(precision, device.type):
                loss = self.model(x, y)
            loss_sum += loss.detach()
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
        for i, s in enumerate(self.servers):
            if s in self.server_info:
                out[f"ps_server{i}_updates"] = self.server_info[s][1]
        if self.server_info:  # bsp / ssp: the global batch's norm of the newest clock in this step's weights
            out["ps_update_grad_norm"] = self.server_info[self.servers[0]][4]
        self.wait_s = self.bytes_pulled = 0.0
        return out
