"""No host synchronisation in the steady-state training step, counted by :mod:`shardwise.dispatch_count`.

A host synchronisation makes the host wait for the device: reading a device tensor's value (``.item()``,
``float()``, ``bool()``, ``.tolist()``, ``.cpu()``), a blocking upload of host data, an operator whose output
shape depends on the data (``nonzero``, boolean indexing, ``unique``), or a device clock read of the step's own
stamps. The counter sees each of them on a CPU by simulating a device (every tensor is a device tensor but those
the code made on the host); :class:`~shardwise.dispatch_count.CallWindow` counts one whole cycle of the real loop
(from one call of ``Engine.forward_backward`` to the next: upload, forward, backward, norm, optimizer step,
metrics, and the read of the step before), after warm-up and before the end of the run. Every layout runs on the
2-rank pool: dense data parallelism (bf16, fp16), tensor parallelism, ZeRO-1/2/3, a 1F1B pipeline (dense, and
with MoE blocks, whose stages join their routers' loads in one gather on the device), ring attention (cp), and
experts over ep 2, whose exchanging dispatch reads the host once per MoE layer (the uneven all-to-all's splits)
and whose padded one never.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_on_ranks
from tests.test_train import make_config

WARMUP = 2
"""The loop's third step is counted (the first steps build the optimizer state and the memory table)."""
MOE_LAYERS = 2
"""tiny-moe: every one of its 2 blocks is a MoE block."""

LAYOUTS = {
    "dp_bf16": ({"train.precision": "bf16"}, 0),
    "dp_fp16": ({"train.precision": "fp16"}, 0),
    "tp": ({"parallel.tp": 2}, 0),
    "zero1": ({"parallel.zero": 1}, 0),
    "zero2": ({"parallel.zero": 2}, 0),
    "zero3": ({"parallel.zero": 3}, 0),
    "pp": ({"parallel.pp": 2, "parallel.microbatches": 2}, 0),
    "pp_moe": ({"model.preset": "tiny-moe", "parallel.pp": 2, "parallel.microbatches": 2}, 0),
    "cp": ({"parallel.cp": 2}, 0),
    "ep": ({"model.preset": "tiny-moe", "parallel.ep": 2}, MOE_LAYERS),
    "ep_padded": ({"model.preset": "tiny-moe", "parallel.ep": 2, "parallel.ep_dispatch": "padded",
                   "model.moe_capacity_factor": 1.0}, 0),
}
"""layout -> (config overrides on 2 ranks, host synchronisations allowed per rank and step)."""


def count_step_syncs(cfg, run_dir: str) -> dict[str, dict[str, int]]:
    """This rank's host synchronisations in one steady-state cycle of the training loop, by call site and kind."""
    import torch.distributed as dist

    from shardwise.dispatch_count import CallWindow
    from shardwise.train.engine import Engine
    from shardwise.train.loop import train

    window = CallWindow(Engine, "forward_backward", WARMUP)
    try:
        train(cfg, Path(run_dir), stop_after=WARMUP + 2)  # the window closes as the step after it starts
    finally:
        counts = window.close()
    dist.barrier()  # a run leaves no message in flight (a ZeRO gather would meet this barrier instead)
    assert counts is not None, "the counted step never started"
    return counts.syncs_by_site()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_training_step_does_not_wait_for_the_device(tmp_path, cache_dir, layout):
    overrides, allowed = LAYOUTS[layout]
    cfg = make_config(tmp_path, cache_dir, 2, **{"train.steps": 10, "train.global_batch": 4, **overrides})
    for rank, sites in enumerate(run_on_ranks(2, count_step_syncs, cfg, str(tmp_path))):
        n = sum(sum(kinds.values()) for kinds in sites.values())
        assert n == allowed, f"{layout}, rank {rank}: {n} host synchronisations per step (allowed {allowed}): {sites}"
        if allowed:  # the exchanging dispatch's one read per MoE layer, nothing else
            assert all(site.startswith("shardwise/parallel/expert/dispatch.py") for site in sites), sites
