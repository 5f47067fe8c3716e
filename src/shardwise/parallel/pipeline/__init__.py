"""Pipeline parallelism: partition a model into stages by layers, run them with a schedule
(naive, GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1), pass activations and gradients point-to-point, and measure
the bubble. See ``partition``, ``schedules``, ``p2p``, ``executor``, ``zero_bubble``, ``clip`` and ``timeline``.

Typical use on each rank of a pipeline (``stage_ranks`` = ``mesh.ranks("pp")``)::

    p, v = len(stage_ranks), 1                       # v > 1 only for "interleaved"
    split = partition(cfg, p * v, method="params")  # blocks of every global stage
    r = stage_ranks.index(dist.get_rank())
    chunks = [build_stage(cfg, c * p + r, p * v, split[c * p + r], seed) for c in range(v)]
    pipe = Pipeline(chunks, stage_ranks, "1f1b", n_microbatches=m, d_model=cfg.d_model)
    loss = pipe.step(tokens, targets)                # grads accumulated; loss on the last stage only

The names below are imported on first use (:mod:`shardwise.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.lazy import lazy_exports

_EXPORTS = {
    "Action": "shardwise.parallel.pipeline.schedules",
    "Event": "shardwise.parallel.pipeline.timeline",
    "Pipeline": "shardwise.parallel.pipeline.executor",
    "SCHEDULES": "shardwise.parallel.pipeline.checks",
    "StageModule": "shardwise.parallel.pipeline.partition",
    "Timeline": "shardwise.parallel.pipeline.timeline",
    "WeightGradStore": "shardwise.parallel.pipeline.zero_bubble",
    "balanced_split": "shardwise.parallel.pipeline.partition",
    "bubble_fraction": "shardwise.parallel.pipeline.timeline",
    "build_schedule": "shardwise.parallel.pipeline.schedules",
    "build_stage": "shardwise.parallel.pipeline.partition",
    "check_pipeline": "shardwise.parallel.pipeline.checks",
    "check_schedule": "shardwise.parallel.pipeline.checks",
    "chrome_trace": "shardwise.parallel.pipeline.timeline",
    "clip_grad_norm": "shardwise.parallel.pipeline.clip",
    "compute_order": "shardwise.parallel.pipeline.schedules",
    "defer_linear_weight_grads": "shardwise.parallel.pipeline.zero_bubble",
    "even_split": "shardwise.parallel.pipeline.partition",
    "gather_timelines": "shardwise.parallel.pipeline.timeline",
    "global_grad_norm": "shardwise.parallel.pipeline.clip",
    "layer_costs": "shardwise.parallel.pipeline.partition",
    "manual_split": "shardwise.parallel.pipeline.partition",
    "peak_live": "shardwise.parallel.pipeline.schedules",
    "plot_gantt": "shardwise.parallel.pipeline.timeline",
    "replayed_bubble": "shardwise.parallel.pipeline.timeline",
    "simulate": "shardwise.parallel.pipeline.schedules",
    "split_microbatches": "shardwise.parallel.pipeline.executor",
    "theoretical_bubble": "shardwise.parallel.pipeline.schedules",
    "write_chrome_trace": "shardwise.parallel.pipeline.timeline",
    "zb_h1_bubble": "shardwise.parallel.pipeline.schedules",
}

__all__ = [
    "Action", "Event", "Pipeline", "SCHEDULES", "StageModule", "Timeline", "WeightGradStore", "balanced_split",
    "bubble_fraction", "build_schedule", "build_stage", "check_pipeline", "check_schedule", "chrome_trace",
    "clip_grad_norm", "compute_order", "defer_linear_weight_grads", "even_split", "gather_timelines",
    "global_grad_norm", "layer_costs", "manual_split", "peak_live", "plot_gantt", "replayed_bubble", "simulate",
    "split_microbatches", "theoretical_bubble", "write_chrome_trace", "zb_h1_bubble",
]

if TYPE_CHECKING:
    from shardwise.parallel.pipeline.checks import SCHEDULES, check_pipeline, check_schedule
    from shardwise.parallel.pipeline.clip import clip_grad_norm, global_grad_norm
    from shardwise.parallel.pipeline.executor import Pipeline, split_microbatches
    from shardwise.parallel.pipeline.partition import (
        StageModule,
        balanced_split,
        build_stage,
        even_split,
        layer_costs,
        manual_split,
    )
    from shardwise.parallel.pipeline.schedules import (
        Action,
        build_schedule,
        compute_order,
        peak_live,
        simulate,
        theoretical_bubble,
        zb_h1_bubble,
    )
    from shardwise.parallel.pipeline.timeline import (
        Event,
        Timeline,
        bubble_fraction,
        chrome_trace,
        gather_timelines,
        plot_gantt,
        replayed_bubble,
        write_chrome_trace,
    )
    from shardwise.parallel.pipeline.zero_bubble import WeightGradStore, defer_linear_weight_grads

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
