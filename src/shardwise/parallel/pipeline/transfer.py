"""Point-to-point passing of activations (forward) and their gradients (backward) between stages.

Every message's shape and dtype are known on both ends before the step (the activation of one
micro-batch is ``[micro_batch, seq_len, d_model]`` everywhere), so there is no shape handshake.
Consecutive communication actions of a schedule are posted together with
``torch.distributed.batch_isend_irecv`` (Narayanan et al. 2021 §4.1 batch a stage's sends and
receives the same way). Sends are never waited for before the step ends -- the transport progresses
them in the background -- and a receive is waited for only when the computation that needs it starts,
so no ordering between neighbours beyond the schedule's own data dependencies is imposed.

Every message has its own tag (kind, receiving stage, micro-batch), so messages between one pair of
ranks in both directions (interleaved schedules wrap stage ``p - 1`` back to rank 0) never mismatch.

gloo's point-to-point takes CPU tensors only, so a GPU tensor on a group whose CUDA backend is gloo
(stages sharing one GPU: NCCL refuses two ranks on one device) travels through host memory: a send
copies it to the CPU first, a receive lands in a CPU buffer and is copied onto the device when it is
waited for (:class:`StagedWork`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.dist.comm.counting import CommStats, nbytes
from shardwise.dist.devices import group_backends
from shardwise.parallel.pipeline.schedules import RECV_F, SEND_F, Action


def message_tag(kind: str, dst_stage: int, mb: int, n_stages: int) -> int:
    """The tag of a message: forward or backward, the stage receiving it, its micro-batch."""
    fwd = kind in (SEND_F, RECV_F)
    return (mb * n_stages + dst_stage) * 2 + (0 if fwd else 1)


class StagedWork:
    """A transfer of a host copy: keeps the copy alive until waited for; a receive's ``wait()`` then
    copies it onto the device tensor (``device_tensor``; ``None`` for a send)."""

    def __init__(self, work: dist.Work, host: torch.Tensor, device_tensor: torch.Tensor | None):
        self.work, self.host, self.device_tensor = work, host, device_tensor

    def wait(self, *args) -> bool:
        done = self.work.wait(*args)
        if self.host is not None and self.device_tensor is not None:
            self.device_tensor.copy_(self.host)
        self.host = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


class P2P:
    """Posts the sends and receives of one pipeline rank.

    ``stage_ranks[r]`` is the global rank (in ``group``) of pipeline rank ``r``; with pp x dp this is
    the pipeline of this rank's data-parallel replica. ``n_chunks`` chunks per rank make
    ``len(stage_ranks) * n_chunks`` stages."""

    def __init__(self, stage_ranks: list[int], n_chunks: int = 1, group: dist.ProcessGroup | None = None,
                 stats: CommStats | None = None):
        self.stage_ranks = list(stage_ranks)
        self.p = len(stage_ranks)
        self.n_stages = self.p * n_chunks
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        """Every send is recorded here: handed and on the wire alike (a send is its own message)."""
        if dist.get_rank() not in self.stage_ranks:
            raise ValueError(f"rank {dist.get_rank()} is not in the pipeline's stage_ranks {self.stage_ranks}")
        self.rank = self.stage_ranks.index(dist.get_rank())
        self.stage_through_host: bool | None = None
        """Send through host memory: None decides per tensor (a non-CPU tensor on a gloo backend); True
        always (tests exercise the path on the CPU)."""
        self._backends = group_backends(group)

    def staged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` must travel through host memory on this group."""
        if self.stage_through_host is not None:
            return self.stage_through_host
        return tensor.device.type != "cpu" and self._backends.get(tensor.device.type) == "gloo"

    def p2p_op(self, send: bool, tensor: torch.Tensor, peer: int, tag: int,
               count: bool = True) -> tuple[dist.P2POp, torch.Tensor | None]:
        """One ``P2POp`` to global rank ``peer`` (a send counted unless ``count`` is false); with the host
        copy it carries when staged (``None`` otherwise)."""
        host = None
        if self.staged(tensor):
            host = tensor.detach().cpu() if send else torch.empty(tensor.shape, dtype=tensor.dtype)
        if send and count:
            self.count_send(tensor)
        op = dist.P2POp(dist.isend if send else dist.irecv, tensor if host is None else host, peer, self.group, tag)
        return op, host

    def start(self, ops: list[tuple[bool, torch.Tensor, int, int]], count: bool = True) -> list:
        """Post ``(send?, tensor, global peer, tag)`` operations in one batch; one handle per op (a
        staged receive's handle copies onto the device when waited for)."""
        if not ops:
            return []
        posted = [self.p2p_op(*op, count=count) for op in ops]
        works = dist.batch_isend_irecv([op for op, _ in posted])
        if len(works) != len(posted):  # a coalescing backend (nccl) returns one handle; nothing is staged there
            return works
        return [w if host is None else StagedWork(w, host, None if send else tensor)
                for w, (_, host), (send, tensor, _, _) in zip(works, posted, ops, strict=True)]

    def exchange(self, send: list[tuple[torch.Tensor, int, int]], recv: list[tuple[torch.Tensor, int, int]],
                 count: bool = True) -> None:
        """Blocking sends and receives of ``(tensor, global peer, tag)`` (sends counted unless ``count`` is false)."""
        for work in self.start([(True, *s) for s in send] + [(False, *r) for r in recv], count):
            work.wait()

    def _dst_stage(self, a: Action, local_stage: int) -> int:
        """The stage that receives the message of action ``a`` taken by ``local_stage``."""
        if a.kind in ("recv_f", "recv_b"):
            return local_stage
        return local_stage + (1 if a.kind == SEND_F else -1)

    def post(self, ops: list[tuple[Action, torch.Tensor]]) -> list[dist.Work]:
        """Post ``(action, tensor)`` pairs in one batch; returns one ``Work`` per op, in order."""
        out = []
        for a, tensor in ops:
            stage = a.chunk * self.p + self.rank
            tag = message_tag(a.kind, self._dst_stage(a, stage), a.mb, self.n_stages)
            out.append((a.kind.startswith("send"), tensor, self.stage_ranks[a.peer], tag))
        return self.start(out)

    def count_send(self, tensor: torch.Tensor) -> None:
        """Record one message of ``tensor`` sent from this rank."""
        self.stats.hand(nbytes(tensor), backend=False)
        self.stats.send(nbytes(tensor))
