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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.dist.comm.counting import CommStats, nbytes
from shardwise.parallel.pipeline.schedules import RECV_F, SEND_F, Action


def message_tag(kind: str, dst_stage: int, mb: int, n_stages: int) -> int:
    """The tag of a message: forward or backward, the stage receiving it, its micro-batch."""
    fwd = kind in (SEND_F, RECV_F)
    return (mb * n_stages + dst_stage) * 2 + (0 if fwd else 1)


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

    def _dst_stage(self, a: Action, local_stage: int) -> int:
        """The stage that receives the message of action ``a`` taken by ``local_stage``."""
        if a.kind in ("recv_f", "recv_b"):
            return local_stage
        return local_stage + (1 if a.kind == SEND_F else -1)

    def post(self, ops: list[tuple[Action, torch.Tensor]]) -> list[dist.Work]:
        """Post ``(action, tensor)`` pairs in one batch; returns one ``Work`` per op, in order."""
        p2p = []
        for a, tensor in ops:
            stage = a.chunk * self.p + self.rank
            tag = message_tag(a.kind, self._dst_stage(a, stage), a.mb, self.n_stages)
            fn = dist.isend if a.kind.startswith("send") else dist.irecv
            if fn is dist.isend:
                self.count_send(tensor)
            p2p.append(dist.P2POp(fn, tensor, self.stage_ranks[a.peer], self.group, tag))
        if not p2p:
            return []
        return dist.batch_isend_irecv(p2p)

    def count_send(self, tensor: torch.Tensor) -> None:
        """Record one message of ``tensor`` sent from this rank."""
        self.stats.hand(nbytes(tensor), backend=False)
        self.stats.send(nbytes(tensor))
