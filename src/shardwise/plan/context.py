"""What context parallelism costs one rank per step: the bytes it hands to the cp axis and the attention
activations it keeps for backward -- predicted from the shapes alone, under the trainer's metric names
(``cp_sent_bytes``, ``cp_attn_act_bytes``) so that ``plan --compare`` can hold them against a run.

Per layer and micro-batch, with ``t = s / cp`` local tokens, ``H`` query and ``Hkv`` key/value heads per
tensor-parallel rank, head size ``d`` and ``KV = 2 b Hkv t d`` key/value elements:

* ring (Liu et al. 2023, Algorithm 1): forward ``cp - 1`` sends of ``KV`` (compute dtype); backward
  ``cp - 1`` sends of ``KV`` again and ``cp`` sends of their fp32 gradients;
* all-gather (Megatron-Core): forward an all-gather of ``cp KV`` (its output), backward a reduce-scatter
  of ``cp KV`` (its input);
* Ulysses (Jacobs et al. 2023, §3): forward all-to-alls of ``q`` (``b H t d``), of ``KV`` (kv heads first
  repeated up to cp when there are fewer) and of the output (``b H t d``); backward the same three.

Recomputation (selective or full) runs the attention's forward, and its communication, again in backward.
The loss adds one int64 all-reduce (the token count of the sequence) per micro-batch on the last stage.

Activations kept by the ring per layer and micro-batch: its inputs ``q, k, v`` (compute dtype), the fp32
output and the fp32 log-sum-exp -- ``O(s / cp)``: the per-rank activation memory falls as ``1/cp``.
"""

from __future__ import annotations

from shardwise.plan.spec import Layout, ModelSpec
from shardwise.plan.tensors import rank_blocks

FP32, INT64 = 4, 8


def local_heads(m: ModelSpec, tp: int) -> tuple[int, int]:
    """Query and key/value heads one tensor-parallel rank computes (kv heads replicated when tp > Hkv)."""
    return m.n_heads // tp, max(m.n_kv_heads // tp, 1)


def _layers_on_rank0(m: ModelSpec, lay: Layout, layers: int | None) -> int:
    return layers if layers is not None else rank_blocks(m, lay, 0)


def cp_sent_bytes(m: ModelSpec, lay: Layout, s: int, algorithm: str = "ring", act_bytes: int = FP32,
                  layers: int | None = None, last_stage: bool | None = None) -> float:
    """Bytes one cp rank (of pipeline stage 0 unless ``last_stage``) hands to the cp axis in one step,
    as the counting layer measures them (``cp_sent_bytes``). ``layers``: the blocks it holds (default
    ``n_layers / pp``)."""
    if lay.cp == 1:
        return 0.0
    cp, b, t, d = lay.cp, lay.micro_batch, s // lay.cp, m.head_dim
    heads, kv_heads = local_heads(m, lay.tp)
    kv = 2 * b * kv_heads * t * d
    passes = 2 if lay.recompute != "none" else 1
    if algorithm == "ring":
        fwd, bwd = (cp - 1) * kv * act_bytes, (cp - 1) * kv * act_bytes + cp * kv * FP32
    elif algorithm == "allgather":
        fwd = bwd = cp * kv * act_bytes
    elif algorithm == "ulysses":
        rep = 1 if kv_heads % cp == 0 else cp // kv_heads
        fwd = bwd = (2 * b * heads * t * d + kv * rep) * act_bytes
    else:
        raise ValueError(f"parallel.cp_algorithm={algorithm!r} is not valid; use 'ring', 'allgather' or 'ulysses'")
    per_micro = _layers_on_rank0(m, lay, layers) * (passes * fwd + bwd)
    last = lay.pp == 1 if last_stage is None else last_stage
    return float(lay.grad_accum * (per_micro + (INT64 if last else 0)))


def ring_activation_bytes(m: ModelSpec, lay: Layout, s: int, act_bytes: int = FP32,
                          layers: int | None = None) -> float:
    """Bytes the ring attention cores of one rank keep for backward during one micro-batch's forward
    (``cp_attn_act_bytes``): ``q, k, v`` in the compute dtype, the output and log-sum-exp in fp32."""
    b, t, d = lay.micro_batch, s // lay.cp, m.head_dim
    heads, kv_heads = local_heads(m, lay.tp)
    per_layer = b * t * d * (heads + 2 * kv_heads) * act_bytes + b * heads * t * (d + 1) * FP32
    return float(_layers_on_rank0(m, lay, layers) * per_layer)
