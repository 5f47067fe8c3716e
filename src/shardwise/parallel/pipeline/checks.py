"""The config rules of pipeline parallelism, functions of the config alone (no torch): stages against
layers, the schedule against the micro-batch count, the batch against the micro-batches, the partition."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from shardwise.checks import Unused, choice, positive
from shardwise.config import CHOICES, PP_SCHEDULES, Config, ConfigError

SCHEDULES = PP_SCHEDULES
"""The schedules :mod:`.schedules` builds."""


def check_stages(n_layers: int, n_stages: int, slots: int = 0, pp: int | None = None) -> None:
    """Every stage needs at least one block, or the embedding's or the head's slot (``slots`` of them, see
    :func:`even_stage_sizes`). ``pp``: the pipeline ranks, so that a refusal names the real bound on
    ``parallel.pp_virtual`` (``n_stages = pp * pp_virtual``)."""
    if n_stages < 1:
        raise ValueError(f"the number of pipeline stages must be >= 1, got {n_stages}")
    places = n_layers + slots
    if n_stages > places:
        what = f"model.n_layers={n_layers}" + (f" + {slots} slot(s) for the embedding / head" if slots else "")
        if pp is not None and n_stages != pp:
            bound = (f"with parallel.pp={pp} use parallel.pp_virtual <= {places // pp}" if places >= pp else
                     f"use parallel.pp <= {places} with parallel.pp_virtual=1")
            raise ValueError(f"parallel.pp={pp} x parallel.pp_virtual={n_stages // pp} = {n_stages} pipeline "
                             f"stages exceed {what}; every stage needs at least one block: {bound}")
        raise ValueError(f"{n_stages} pipeline stages (parallel.pp * parallel.pp_virtual) exceed {what}; every "
                         f"stage needs at least one block: use at most {places} stages")


def even_stage_sizes(n_layers: int, n_stages: int, embedding_slot: bool = False,
                     head_slot: bool = False) -> list[int]:
    """The blocks of every stage of the even split -- the one rule the trainer, the planner and the simulator
    share. The layers and the slots (the embedding's on the first stage with ``embedding_slot``, the head's on
    the last with ``head_slot``: each takes a block's place, as Megatron-LM's account-for-embedding /
    account-for-loss in its pipeline split; Llama 3, Dubey et al. 2024 §3.3.2, takes one layer from the first
    and the last stage) are split as evenly as possible, the first ``places % n_stages`` stages one place more;
    a stage may then hold its slot alone (no block). Any count of layers that leaves every stage a place is
    valid: nothing has to divide."""
    slots = int(embedding_slot) + int(head_slot)
    check_stages(n_layers, n_stages, slots)
    base, extra = divmod(n_layers + slots, n_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
    sizes[0] -= int(embedding_slot)
    sizes[-1] -= int(head_slot)
    if min(sizes) < 0:  # one stage holding both slots (n_stages == 1) has room for them and the blocks
        raise ValueError(f"{n_stages} stage(s) cannot give the embedding and the head a slot each beside "
                         f"{n_layers} layers")
    return sizes


def check_boundaries(n_layers: int, boundaries: Sequence[int]) -> list[int]:
    """The first block of every stage after the first, strictly increasing within (0, n_layers)."""
    b = list(boundaries)
    check_stages(n_layers, len(b) + 1)
    if any(lo >= hi for lo, hi in pairwise([0, *b, n_layers])):
        raise ValueError(f"pipeline split boundaries {b} must be strictly increasing within (0, {n_layers})")
    return b


def check_manual(n_layers: int, n_stages: int, boundaries: Sequence[int] | None) -> None:
    """A manual split gives one boundary fewer than the stages."""
    if boundaries is None:
        raise ValueError("partition method 'manual' needs boundaries (the first block of stages 1..n-1)")
    if len(boundaries) != n_stages - 1:
        raise ValueError(f"{len(boundaries)} split boundaries give {len(boundaries) + 1} stages, not {n_stages}")
    check_boundaries(n_layers, boundaries)


def check_schedule(schedule: str, n_ranks: int, n_microbatches: int, n_chunks: int = 1) -> None:
    """Raise ``ValueError`` naming the config field if ``schedule`` cannot run this shape."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r} is not valid; use one of {', '.join(SCHEDULES)}")
    if n_microbatches < 1:
        raise ValueError(f"parallel.microbatches={n_microbatches} must be >= 1")
    if schedule == "naive" and n_microbatches != 1:
        raise ValueError(f"parallel.microbatches={n_microbatches} cannot run with pp_schedule='naive', "
                         "which passes the whole batch at once; use 1, or pp_schedule='gpipe'/'1f1b'")
    if schedule == "interleaved":
        if n_chunks < 2:
            raise ValueError(f"parallel.pp_virtual={n_chunks} must be >= 2 for pp_schedule='interleaved'")
        if n_microbatches % n_ranks:
            raise ValueError(f"parallel.microbatches={n_microbatches} is not a multiple of parallel.pp={n_ranks}, "
                             f"which pp_schedule='interleaved' needs; use {n_ranks}, {2 * n_ranks}, ...")
    elif n_chunks != 1:
        raise ValueError(f"parallel.pp_virtual={n_chunks} needs pp_schedule='interleaved' (got {schedule!r}); use 1")


def check_pipeline(n_layers: int, pp: int, schedule: str, microbatches: int, global_batch: int,
                   virtual: int = 1, slots: int = 0) -> None:
    """Every pipeline check that needs no processes: stages vs layers (and the embedding / head slots), the
    schedule vs the micro-batch count, the batch vs the micro-batch count. Meant for config validation before
    spawning."""
    check_stages(n_layers, pp * virtual, slots, pp)
    check_schedule(schedule, pp, microbatches, virtual)
    if global_batch % microbatches:
        raise ValueError(f"a batch of {global_batch} sequences does not split into parallel.microbatches="
                         f"{microbatches} equal micro-batches; use a divisor of {global_batch}")


def pipeline_partition(text: str) -> tuple[str, list[int] | None]:
    """``parallel.pp_partition`` as ``(method, boundaries)``: a method name, or "2,5" -> ("manual", [2, 5])."""
    text = str(text).strip()
    if text and all(part.strip().isdigit() for part in text.split(",")):
        return "manual", [int(part) for part in text.split(",")]
    if text not in CHOICES["parallel.pp_partition"]:
        raise ConfigError(f"parallel.pp_partition={text!r} is not valid; use 'even', 'params', 'flops' "
                          "or the first block of each stage after the first, e.g. '2,5'")
    return text, None


def check(cfg: Config) -> None:
    """Pipeline checks that need no processes (stages vs layers, schedule vs micro-batches), and what a
    pipeline does not compose with yet, one line each."""
    p, t = cfg.parallel, cfg.train
    positive("parallel.pp_virtual", p.pp_virtual)
    choice("parallel.pp_schedule", p.pp_schedule)
    method, boundaries = pipeline_partition(p.pp_partition)
    if p.pp == 1:
        if p.pp_virtual != 1:
            raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp > 1; use 1")
        return
    if p.zero == 3 and p.zero_hpz > 1:
        raise ConfigError(f"parallel.zero_hpz={p.zero_hpz} with parallel.pp={p.pp}: a pipeline keeps each stage's "
                          "ZeRO-3 parameters gathered from its first forward to the flush, so there is no backward "
                          "gather for hpZ to keep inside a node; use parallel.zero_hpz=1")
    try:
        check_pipeline(cfg.model.n_layers, p.pp, p.pp_schedule, p.microbatches, t.micro_batch * p.microbatches,
                       p.pp_virtual, int(p.pp_embedding_slot) + int(p.pp_head_slot))
        if method == "manual":  # a cost-balanced split always exists once there are enough layers
            check_manual(cfg.model.n_layers, p.pp * p.pp_virtual, boundaries)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def unused(cfg: Config) -> list[Unused]:
    p = cfg.parallel
    on = p.pp > 1
    return [
        Unused("parallel.microbatches", on, f"counts a pipeline's micro-batches, but parallel.pp=1; use "
               f"train.grad_accum={p.microbatches} for micro-batches accumulated per step"),
        Unused("parallel.pp_schedule", on, "orders a pipeline's stages, but parallel.pp=1; set parallel.pp > 1 or "
               "remove it"),
        Unused("parallel.pp_partition", on, "splits the model into pipeline stages, but parallel.pp=1; "
               "set parallel.pp > 1 or remove it"),
        *(Unused(f"parallel.{name}", on and p.pp_partition == "even",
                 f"gives the {what} a block's place in the even pipeline split, but " +
                 ("parallel.pp=1" if not on else f"parallel.pp_partition={p.pp_partition!r} "
                  "(a cost-balanced split counts the embedding and head already; a given one is the user's)") +
                 "; use parallel.pp_partition='even' with parallel.pp > 1")
          for name, what in (("pp_embedding_slot", "embedding"), ("pp_head_slot", "head"))),
    ]
