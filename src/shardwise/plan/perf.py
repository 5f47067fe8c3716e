"""Step time, throughput, MFU and training time of a layout on a cluster.

  compute      = hardware FLOPs per rank / (peak · efficiency), on the busiest pipeline rank: times its
                 blocks over L/p where the layers do not split evenly (the slowest stage sets the pace)
  bubble       = (p−1)/v micro-batch times: the bubble fraction (p−1)/(v·m) of Narayanan et al.
                 2021, §2.2 (1F1B) and §2.2.2 (interleaved)
  exposed comm = tensor/pipeline/expert parallel in full; data-parallel gradient reduction
                 hidden behind the last micro-batch's backward, ZeRO-3 gathers behind compute,
                 ring attention behind attention (Li et al. 2020, "PyTorch Distributed" §3.2.3;
                 Rajbhandari et al. 2019 §7; Liu et al. 2023) — each up to ``cluster.overlap``
  offload      = gradients down and weights up over PCIe (ZeRO-Offload, Ren et al. 2021 §4.1)
  sync         = collective calls per step (each unit's ZeRO collectives, the loss all-reduce, the
                 gradient norm over shards) x ``cluster.call_latency`` (0 on accelerators): what each
                 synchronisation costs ranks that compute between calls, never hidden
  step time    = compute + bubble + exposed comm + offload + sync
  tokens/s     = global batch · s / step time;  MFU = model FLOPs/token · tokens/s / (world · peak)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.plan.comm import CommItem, comm_items
from shardwise.plan.flops import attention_flops_per_token, flops_per_token
from shardwise.plan.hardware import Cluster
from shardwise.plan.memory import StateDtypes, params_per_rank
from shardwise.plan.spec import Layout, ModelSpec
from shardwise.plan.tensors import stage_blocks
from shardwise.plan.zero_layout import ZeroUnits

PCIE_BW = 25e9
"""Host-device bandwidth per GPU (PCIe 4.0 x16, one direction, ~25 GB/s achievable)."""
NVME_BW = 5e9
"""NVMe bandwidth per GPU for ZeRO-Infinity offload."""


@dataclass
class StepTime:
    compute_s: float
    bubble_s: float
    comm_exposed_s: float
    offload_s: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    flops_per_token: float
    """Model FLOPs per token (the trainer's MFU numerator)."""
    hardware_flops_per_token: float
    bubble_fraction: float
    comm: list[CommItem] = field(default_factory=list)
    sync_s: float = 0.0
    """Collective calls per step x the cluster's per-call latency."""
    collectives_per_step: int = 0
    """Collective calls one rank makes per step (the communication items' and the loop's)."""

    @property
    def comm_bytes(self) -> float:
        """Bytes handed to collectives per step (the trainer's ``comm_bytes``)."""
        return sum(c.total_payload for c in self.comm)

    @property
    def comm_sent_bytes(self) -> float:
        """Bytes this rank sends per step under the collectives' algorithms."""
        return sum(c.sent_bytes for c in self.comm)


def step_time(m: ModelSpec, lay: Layout, s: int, cluster: Cluster, states: StateDtypes, precision: str = "bf16",
              act_bytes: int = 2, units: ZeroUnits | None = None) -> StepTime:
    """Step time, tokens/s and MFU of ``lay``; ``units`` as for :func:`~shardwise.plan.comm.comm_items`."""
    peak = cluster.gpu.peak(precision)
    tokens = lay.global_batch * s
    model_fpt = flops_per_token(m, s, lay.recompute, "model")
    hw_fpt = flops_per_token(m, s, lay.recompute, "hardware")
    compute = hw_fpt * tokens / lay.world / (peak * cluster.efficiency)
    if lay.pp > 1:  # an uneven split: the busiest rank's blocks set the pace
        compute *= stage_blocks(m, lay) * lay.pp / m.n_layers
    per_micro = compute / lay.grad_accum
    bubble = (lay.pp - 1) / lay.pp_virtual * per_micro if lay.pp > 1 else 0.0
    items = comm_items(m, lay, s, states, cluster, act_bytes, units)
    backward = per_micro * 2 / 3
    attention = compute * attention_flops_per_token(m, s) / hw_fpt
    hide = {"backward": backward * cluster.overlap, "compute": compute * cluster.overlap,
            "attention": attention * cluster.overlap, "none": 0.0}
    by_overlap: dict[str, float] = {}
    for c in items:
        by_overlap[c.overlap] = by_overlap.get(c.overlap, 0.0) + c.time_s
    exposed = sum(max(0.0, t - hide[k]) for k, t in by_overlap.items())
    offload = 0.0
    if lay.offload != "none":
        dense, expert = params_per_rank(m, lay)
        psi = (dense + expert) / (lay.dp * lay.cp)
        b = states.bytes()
        moved = psi * (b["grads"] + b["params"])
        offload = moved / PCIE_BW
        if lay.offload == "disk":
            offload += 2 * psi * (b["master"] + b["optimizer"]) / NVME_BW
    # the loop's loss all-reduce, and with sharded gradients the norm's all-reduce over the shards
    loop_calls = (1 + (lay.zero > 0)) if lay.world > 1 else 0
    calls = sum(c.n_collectives for c in items) + loop_calls
    sync = calls * cluster.call_latency
    total = compute + bubble + exposed + offload + sync
    tps = tokens / total
    return StepTime(compute, bubble, exposed, offload, total, tps, model_fpt * tps / (lay.world * peak), model_fpt,
                    hw_fpt, bubble / (compute + bubble) if compute else 0.0, items, sync, calls)
