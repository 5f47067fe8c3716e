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
"""

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
    partition,
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
    write_chrome_trace,
)
from shardwise.parallel.pipeline.zero_bubble import WeightGradStore, defer_linear_weight_grads

__all__ = [
    "SCHEDULES", "Action", "Event", "Pipeline", "StageModule", "Timeline", "WeightGradStore", "balanced_split",
    "bubble_fraction", "build_schedule", "build_stage", "check_pipeline", "check_schedule", "chrome_trace",
    "clip_grad_norm", "compute_order", "defer_linear_weight_grads", "global_grad_norm",
    "even_split", "gather_timelines", "layer_costs", "manual_split", "partition", "peak_live", "plot_gantt",
    "simulate", "split_microbatches", "theoretical_bubble", "write_chrome_trace", "zb_h1_bubble",
]
