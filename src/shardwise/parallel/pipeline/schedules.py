"""Pipeline schedules as explicit per-rank action lists.

A schedule is, for every pipeline rank, the ordered list of computations it performs in one step:
``F`` (forward) or ``B`` (backward) of micro-batch ``mb`` on its local model chunk ``chunk``. Rank ``r``
chunk ``c`` is global stage ``c * p + r`` (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", §2.2.2: each device holds v non-adjacent chunks).
:func:`with_comm` inserts the point-to-point actions each computation needs (receive its input before,
send its output after); :class:`~shardwise.parallel.pipeline.executor.Pipeline` executes the result.
Keeping schedules as plain data makes them testable (:func:`simulate`) and plottable.

* ``naive``: the whole batch as one micro-batch, one stage busy at a time.
* ``gpipe``: all forwards, then all backwards (Huang et al. 2019, "GPipe", §2.2).
* ``1f1b``: warm-up of ``p - r - 1`` forwards, then one-forward-one-backward, then cool-down
  (PipeDream-Flush; Narayanan et al. 2021 §2.2.1; Harlap et al. 2018 "PipeDream" §3.2): at most
  ``p - r`` micro-batches are live on rank ``r``.
* ``interleaved``: 1F1B over v chunks per rank, forwards and backwards in groups of p micro-batches
  per chunk (Narayanan et al. 2021 §2.2.2); needs ``m % p == 0``.
* ``zb-h1``: zero-bubble ZB-H1 (Qi, Wan, Huang, Lin 2024, "Zero Bubble Pipeline Parallelism", ICLR,
  §3.1 and Fig. 3): backward split into ``B`` (gradient of the stage input) and ``W`` (weight
  gradients, :mod:`~shardwise.parallel.pipeline.zero_bubble`); 1F1B's order of ``F`` and ``B``, with
  rank ``r`` holding back ``r`` ``W`` passes to fill its cool-down, so at most ``p`` micro-batches are
  live on any rank (as on 1F1B's rank 0) and the bubble shrinks to ``(p - 1)(T_F + T_B - T_W)``.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from shardwise.parallel.pipeline.checks import check_schedule

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "send_f", "recv_f", "send_b", "recv_b"
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: compute (``F``/``B``/``W``) or communicate (``send_f`` ... ``recv_b``)
    micro-batch ``mb`` of local chunk ``chunk``; ``peer`` is the pipeline rank on the other end."""

    kind: str
    chunk: int
    mb: int
    peer: int | None = None

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind}{self.chunk}.{self.mb}{peer}"


def compute_order(schedule: str, rank: int, n_ranks: int, n_microbatches: int, n_chunks: int = 1) -> list[Action]:
    """The ``F``/``B`` (and ``W``) actions of pipeline rank ``rank``, in execution order."""
    check_schedule(schedule, n_ranks, n_microbatches, n_chunks)
    p, m, v = n_ranks, n_microbatches, n_chunks
    if schedule in ("naive", "gpipe"):
        return [Action(F, 0, i) for i in range(m)] + [Action(B, 0, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - rank - 1, m)
        out = [Action(F, 0, i) for i in range(warm)]
        for k in range(m - warm):
            out += [Action(F, 0, warm + k), Action(B, 0, k)]
        return out + [Action(B, 0, i) for i in range(m - warm, m)]
    if schedule == "zb-h1":
        return _zb_h1_order(rank, p, m)
    # interleaved: Megatron-LM's forward_backward_pipelining_with_interleaving (Narayanan et al. 2021 §2.2.2)
    total = m * v

    def fwd(k: int) -> Action:
        return Action(F, (k % (p * v)) // p, (k // (p * v)) * p + k % p)

    def bwd(k: int) -> Action:
        return Action(B, v - 1 - (k % (p * v)) // p, (k // (p * v)) * p + k % p)

    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    out = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        out += [fwd(warm + k), bwd(k)]
    return out + [bwd(k) for k in range(total - warm, total)]


def _zb_h1_order(rank: int, p: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024 §3.1, Fig. 3 top): 1F1B's ``F``/``B`` order; after each ``B`` the oldest
    pending ``W`` runs as soon as more than ``rank`` are pending, and the last ``rank`` run at the end.

    Rank ``r`` thus keeps ``p - r`` (1F1B warm-up) plus ``r`` (held-back ``W``) = ``p`` micro-batches
    live at most, and in the cool-down its held-back ``W`` passes fill the time 1F1B spends waiting for
    the backward to come down the pipeline."""
    warm = min(p - rank - 1, m)
    out = [Action(F, 0, i) for i in range(warm)]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        out.append(Action(B, 0, i))
        pending.append(i)
        while len(pending) > rank:
            out.append(Action(W, 0, pending.popleft()))

    for k in range(m - warm):
        out.append(Action(F, 0, warm + k))
        backward(k)
    for i in range(m - warm, m):
        backward(i)
    return out + [Action(W, 0, i) for i in pending]


def with_comm(order: list[Action], rank: int, n_ranks: int, n_chunks: int = 1) -> list[Action]:
    """Insert receives before and sends after each computation that crosses a stage boundary.

    Stage ``s = chunk * p + rank``; its forward input comes from stage ``s - 1`` (rank ``(r - 1) % p``),
    its output goes to ``s + 1``; backward the other way."""
    p, n_stages = n_ranks, n_ranks * n_chunks
    out: list[Action] = []
    for a in order:
        s = a.chunk * p + rank
        if a.kind == F:
            if s > 0:
                out.append(Action(RECV_F, a.chunk, a.mb, (rank - 1) % p))
            out.append(a)
            if s < n_stages - 1:
                out.append(Action(SEND_F, a.chunk, a.mb, (rank + 1) % p))
        elif a.kind == W:  # weight gradients stay on this rank
            out.append(a)
        else:
            if s < n_stages - 1:
                out.append(Action(RECV_B, a.chunk, a.mb, (rank + 1) % p))
            out.append(a)
            if s > 0:
                out.append(Action(SEND_B, a.chunk, a.mb, (rank - 1) % p))
    return out


def build_schedule(schedule: str, n_ranks: int, n_microbatches: int, n_chunks: int = 1) -> list[list[Action]]:
    """Every rank's full action list (computation and communication)."""
    return [with_comm(compute_order(schedule, r, n_ranks, n_microbatches, n_chunks), r, n_ranks, n_chunks)
            for r in range(n_ranks)]


def theoretical_bubble(n_ranks: int, n_microbatches: int, n_chunks: int = 1) -> float:
    """Idle fraction of a flushed pipeline step: (p - 1) / (v * m + p - 1) -- Narayanan et al. 2021
    §2.2.1 (bubble time (p - 1)(t_f + t_b) against m (t_f + t_b) of work) and §2.2.2 (v chunks shrink the
    bubble time by v). v = 1 gives GPipe/1F1B (Huang et al. 2019 §2.2); naive is m = 1."""
    p, m, v = n_ranks, n_microbatches, n_chunks
    return (p - 1) / (v * m + p - 1)


def zb_h1_bubble(n_ranks: int, n_microbatches: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle fraction of a ZB-H1 step: bubble time ``(p - 1)(T_F + T_B - T_W)`` (Qi et al. 2024 §3.1)
    against ``m (T_F + T_B + T_W)`` of work per rank, i.e. ``b / (m (T_F + T_B + T_W) + b)``.

    ``t_b`` is the input-gradient half of the backward and ``t_w`` the weight-gradient half; only their
    ratios matter. The default ``T_F = T_B = T_W`` (the paper's simplifying assumption, §2.1/§3.1)
    gives ``(p - 1) / (3 m + p - 1)``, a third of 1F1B's. Exact (compute only, free communication)
    for ``m >= p``; with ``m < p`` the steady state never forms and the bubble is larger."""
    p, m = n_ranks, n_microbatches
    bubble = (p - 1) * (t_f + t_b - t_w)
    return bubble / (m * (t_f + t_b + t_w) + bubble)


def peak_live(order: list[Action]) -> int:
    """Most micro-batch activations held at once: forwards done whose backward is not -- or, in a
    schedule with ``W`` actions, whose ``W`` is not (the weight gradients need the saved inputs)."""
    release = W if any(a.kind == W for a in order) else B
    live = peak = 0
    for a in order:
        if a.kind == F:
            live += 1
            peak = max(peak, live)
        elif a.kind == release:
            live -= 1
    return peak


def simulate(actions: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0,
             t_w: float = 0.0, durations: dict[tuple[int, str, int, int], float] | None = None,
             ) -> tuple[float, list[list[tuple]]]:
    """Run the action lists with fixed compute times (per chunk), instant communication and
    non-blocking sends; return ``(makespan, per-rank [(kind, chunk, mb, start, end)])``.
    ``B`` costs ``t_b`` and ``W`` ``t_w`` (in a split backward ``t_b`` is the input-gradient half only).
    ``durations`` (``(rank, kind, chunk, mb) -> seconds``), where given, replaces those times action by
    action -- e.g. the times a run measured, to replay its computations without communication
    (:func:`~shardwise.parallel.pipeline.timeline.replayed_bubble`).

    Raises ``RuntimeError`` if the schedule deadlocks (a receive whose send never happens)."""
    n = len(actions)
    pos, clock = [0] * n, [0.0] * n
    sent: dict[tuple, float] = {}  # (kind, dst_rank, chunk_at_dst, mb) -> time available
    spans: list[list[tuple]] = [[] for _ in range(n)]
    n_chunks = 1 + max((a.chunk for acts in actions for a in acts), default=0)
    p = n

    def dst_chunk(rank: int, a: Action) -> int:
        s = a.chunk * p + rank + (1 if a.kind == SEND_F else -1)
        return s // p

    ready = [(0.0, r) for r in range(n)]
    heapq.heapify(ready)
    blocked: set[int] = set()
    while ready:
        _, r = heapq.heappop(ready)
        progressed = True
        while progressed and pos[r] < len(actions[r]):
            a = actions[r][pos[r]]
            progressed = False
            if a.kind in (SEND_F, SEND_B):
                sent[(a.kind, a.peer, dst_chunk(r, a), a.mb)] = clock[r]
                pos[r], progressed = pos[r] + 1, True
                for b in list(blocked):
                    blocked.discard(b)
                    heapq.heappush(ready, (clock[b], b))
            elif a.kind in (RECV_F, RECV_B):
                key = (SEND_F if a.kind == RECV_F else SEND_B, r, a.chunk, a.mb)
                if key not in sent:
                    blocked.add(r)
                    break
                clock[r] = max(clock[r], sent[key])
                pos[r], progressed = pos[r] + 1, True
            else:
                dt = {F: t_f, B: t_b, W: t_w}[a.kind] / n_chunks
                if durations is not None:
                    dt = durations.get((r, a.kind, a.chunk, a.mb), dt)
                spans[r].append((a.kind, a.chunk, a.mb, clock[r], clock[r] + dt))
                clock[r] += dt
                pos[r], progressed = pos[r] + 1, True
    stuck = [r for r in range(n) if pos[r] < len(actions[r])]
    if stuck:
        raise RuntimeError(f"schedule deadlocks: ranks {stuck} wait at {[actions[r][pos[r]] for r in stuck]}")
    return max(clock), spans
