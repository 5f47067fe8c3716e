"""One tree of dataclasses holding every setting of a run.

Every field can be set from a TOML file (``[train] lr = 3e-4``) and overridden on the
command line by its dotted name (``--train.lr 3e-4``). :func:`shardwise.config_resolve.resolve`
fills the derived fields (preset sizes, batch arithmetic, data-parallel size) and validates the
whole tree before any worker process starts (each technique's rules live beside it, in its
``checks.py``); an invalid value raises ``ConfigError`` naming the field, the value and what would
be valid. This module imports nothing of the package but the preset names.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from shardwise.model.presets import PRESET_NAMES


class ConfigError(ValueError):
    """A config value is invalid. The message is one line, fit to show a user."""


# ---- the values of choice-valued fields (the checks validate with CHOICES; tests walk it) -----------

FLAVORS = ("gpt2", "llama", "bert")
OBJECTIVES = ("causal", "mlm", "classify")
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
"""data.format (the same as shardwise.data.sources.FORMATS)."""
TOKENIZERS = ("byte", "bpe")
"""data.tokenizer's named values; a path to a tokenizer.json is valid too."""
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_MODES = ("none", "full", "selective")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "disk")
ZERO_PARAM_DTYPES = ("fp32", "bf16")
EP_DISPATCHES = ("exchange", "padded")
"""parallel.ep_dispatch (shardwise.parallel.expert.dispatch / .padded)."""
GRAD_REDUCE_DTYPES = ("auto", "fp32", "bf16")
PP_SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
"""parallel.pp_schedule (the same as shardwise.parallel.pipeline.SCHEDULES, which needs torch)."""
PP_PARTITIONS = ("even", "params", "flops")
"""parallel.pp_partition's methods; a list of stage boundaries ("2,5") is valid too."""
BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")
COMM_ALGORITHMS = ("auto", "native", "naive", "star", "ring", "rabenseifner", "recursive_doubling", "tree",
                   "hierarchical", "torus")
"""Gradient all-reduce algorithms (shardwise.dist.comm.allreduce; "auto" asks the cost model)."""
COMM_COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk")
"""Gradient compression methods (shardwise.dist.comm.compress)."""
CP_ALGORITHMS = ("ring", "allgather", "ulysses")
"""parallel.cp_algorithm (the same as shardwise.parallel.context.ALGORITHMS, which needs torch)."""
CP_BALANCES = ("headtail", "none")
"""parallel.cp_balance (shardwise.parallel.context.layout.BALANCES)."""
MOE_ROUTERS = ("softmax", "softmax_renorm", "sigmoid_bias")
"""model.moe_router (the same as shardwise.model.moe.ROUTERS, which needs torch)."""
NORM_PLACEMENTS = ("pre", "sandwich", "post")
"""model.norm_placement (shardwise.model.transformer.NORM_PLACEMENTS)."""
QK_NORM_SCOPES = ("head", "projection")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
"""model.mlp_activation (shardwise.model.layers.GATED_ACTIVATIONS)."""
HF_MODEL_TYPES = ("", "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "gemma2", "gemma3_text", "olmo2",
                  "phi3", "deepseek_v3")
"""model.hf_model_type: "" (implied by the fields) or a transformers model_type an export can write."""
PS_CONSISTENCIES = ("bsp", "asp", "ssp")
"""ps.consistency (the same as shardwise.ps.consistency.MODES)."""
PS_SCHEDULINGS = ("fifo", "priority")
"""ps.scheduling (the same as shardwise.ps.scheduling.POLICIES)."""

CHOICES: dict[str, tuple] = {
    "model.preset": PRESET_NAMES, "model.flavor": FLAVORS, "model.moe_router": MOE_ROUTERS,
    "model.norm_placement": NORM_PLACEMENTS, "model.qk_norm_scope": QK_NORM_SCOPES,
    "model.mlp_activation": MLP_ACTIVATIONS, "model.hf_model_type": HF_MODEL_TYPES,
    "data.format": DATA_FORMATS, "data.tokenizer": TOKENIZERS,
    "train.precision": PRECISIONS, "train.objective": OBJECTIVES, "train.recompute": RECOMPUTE_MODES,
    "parallel.zero": ZERO_STAGES, "parallel.offload": OFFLOADS,
    "parallel.zero_param_dtype": ZERO_PARAM_DTYPES, "parallel.grad_reduce_dtype": GRAD_REDUCE_DTYPES,
    "parallel.pp_schedule": PP_SCHEDULES,
    "parallel.pp_partition": PP_PARTITIONS, "parallel.backend": BACKENDS, "run.device": DEVICES,
    "comm.algorithm": COMM_ALGORITHMS, "comm.compression": COMM_COMPRESSIONS,
    "parallel.cp_algorithm": CP_ALGORITHMS, "parallel.cp_balance": CP_BALANCES,
    "parallel.ep_dispatch": EP_DISPATCHES,
    "ps.consistency": PS_CONSISTENCIES, "ps.scheduling": PS_SCHEDULINGS,
}
"""Every choice-valued field and the values it accepts (data.tokenizer and parallel.pp_partition also
take a path / stage boundaries)."""


@dataclass
class ModelConfig:
    preset: str = "cpu-demo"
    """Named size (see shardwise.model.presets) or "custom"; explicit fields override it."""
    flavor: str | None = None
    """"gpt2" (LayerNorm, GELU, learned positions, tied embeddings), "llama" (RMSNorm, SwiGLU, RoPE, GQA) or
    "bert" (bidirectional encoder: post-norm, exact GELU, learned positions and token types, masked-LM head)."""
    n_layers: int | None = None
    """Number of transformer blocks."""
    d_model: int | None = None
    """Hidden size."""
    n_heads: int | None = None
    """Attention (query) heads; must divide d_model."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (llama); default n_heads. gpt2 requires n_heads."""
    d_ff: int | None = None
    """MLP inner size; default 4*d_model (gpt2) or 2/3*4*d_model rounded up to a multiple of 64 (llama)."""
    vocab_size: int | None = None
    """Embedding rows; default: the tokenizer's vocabulary size. Must be >= it."""
    max_seq_len: int | None = None
    """Longest sequence the model supports (size of the learned position table for gpt2)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """With flavor = "llama": base of the rotary position frequencies."""
    dropout: float = 0.0
    """Dropout probability on attention and residual branches."""
    tie_embeddings: bool | None = None
    """Share token embedding and output head; default True for gpt2, False for llama."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation (GPT-2 scheme)."""
    n_classes: int = 0
    """With train.objective = "classify": classes of bert's [CLS] classifier (labels 0..n_classes-1)."""
    init_from: str = ""
    """Start from pretrained weights instead of the seeded initialisation: "hf:PATH", a transformers
    directory (config.json + safetensors: GPT-2, BERT, Llama, Qwen2/3, Qwen3-MoE, Mixtral, Mistral, Gemma 2/3,
    OLMo 2, Phi-3, DeepSeek-V3) whose config.json gives the model's shape (planning needs the config.json
    alone); "" = initialise from train.seed."""
    n_experts: int | None = None
    """Routed experts per mixture-of-experts block (shardwise.model.moe); 0 = dense; default the preset's (0)."""
    moe_top_k: int = 2
    """With n_experts > 0: experts each token is routed to (1..n_experts)."""
    moe_every: int = 1
    """With n_experts > 0: every k-th block is MoE (the last of each run of k; 1 = every block)."""
    moe_shared: int = 0
    """With n_experts > 0: shared experts every token passes through (DeepSeekMoE), one MLP of moe_shared times a
    routed expert's width (moe_d_ff, or d_ff)."""
    moe_capacity_factor: float = 0.0
    """With n_experts > 0: expert capacity ceil(cf*k*tokens/E) per forward, overflow dropped; 0 = dropless."""
    moe_aux_coeff: float = 0.01
    """With n_experts > 0: weight of the Switch load-balancing loss E*sum f_i P_i added to the training loss."""
    moe_z_coeff: float = 0.001
    """With n_experts > 0: weight of the ST-MoE router z-loss added to the training loss."""
    moe_router: str = "softmax"
    """With n_experts > 0: how a token picks its experts and weighs them: "softmax" (top-k of the softmax,
    un-normalised gates: Switch / GShard), "softmax_renorm" (those k gates renormalised to sum 1: Mixtral,
    Qwen3-MoE) or "sigmoid_bias" (sigmoid scores, top-k by score + a per-expert bias that balances the load
    without an auxiliary loss, gates the normalised scores: DeepSeek-V3)."""
    moe_bias_rate: float = 0.001
    """With moe_router = "sigmoid_bias": after each step every expert's bias moves by this much towards balance
    (+rate for an expert below the mean load, -rate above it)."""
    moe_d_ff: int | None = None
    """With n_experts > 0: inner size of each routed expert (Qwen3-MoE's moe_intermediate_size); default d_ff."""
    qk_norm: bool = False
    """With flavor = "llama": RMSNorm over the queries and keys before the rotary embedding (Qwen3, OLMo 2)."""
    qk_norm_scope: str = "head"
    """With qk_norm: "head" (one norm of head_dim per query and key head: Qwen3, Gemma 3) or "projection" (one
    norm over the whole q and k projections: OLMo 2)."""
    head_dim: int | None = None
    """With flavor = "llama": width of each attention head; q, k and v project to n_heads * head_dim (and
    n_kv_heads * head_dim); default d_model / n_heads. With kv_lora_rank: the query-key width of a head
    (DeepSeek's qk_nope_head_dim + qk_rope_head_dim)."""
    qkv_bias: bool = False
    """With flavor = "llama": biases on the q, k and v projections only (Qwen2)."""
    rope_scaling: str = ""
    """With flavor = "llama": rotary frequency scaling "KIND:key=value,...", the keys of a transformers rope
    block: "linear:factor=F", "llama3:factor=8,low_freq_factor=1,high_freq_factor=4,
    original_max_position_embeddings=8192" (Llama 3.1), "yarn:factor=F,original_max_position_embeddings=N[,
    beta_fast=32,beta_slow=1,mscale=M,mscale_all_dim=A,attention_factor=X]"; "" = none
    (shardwise.model.rope_scaling)."""
    rope_dim: int | None = None
    """With flavor = "llama": dims of each head the rotary embedding rotates, the leading ones (Phi-3's
    partial_rotary_factor * head_dim); default all. With kv_lora_rank: the decoupled rotary part of each query and
    key head (DeepSeek's qk_rope_head_dim), required."""
    rope_local_theta: float = 0.0
    """With sliding_window and sliding_global_every: the rotary base of the sliding blocks, unscaled (Gemma 3's
    rope_local_base_freq); 0 = the global blocks' rotation."""
    sliding_window: int = 0
    """With flavor = "llama": a query attends to itself and the sliding_window - 1 positions before it (Mistral,
    Gemma 2/3's local blocks); 0 = the whole prefix."""
    sliding_global_every: int = 0
    """With sliding_window: every k-th block (the last of each run of k) attends to the whole prefix (Gemma 2: 2,
    Gemma 3: 6); 0 = every block slides."""
    attn_scale_dim: float = 0.0
    """With flavor = "llama": attention scores are q.k / sqrt(attn_scale_dim) (Gemma's query_pre_attn_scalar);
    0 = sqrt(head_dim)."""
    attn_softcap: float = 0.0
    """With flavor = "llama": attention scores soft-capped to cap * tanh(score / cap) (Gemma 2); 0 = none."""
    final_softcap: float = 0.0
    """With flavor = "llama": output logits soft-capped to cap * tanh(logit / cap) (Gemma 2); 0 = none."""
    norm_placement: str = "pre"
    """With flavor = "llama": "pre" (x + f(norm(x))), "sandwich" (x + norm(f(norm(x))): Gemma 2/3) or "post"
    (x + norm(f(x)): OLMo 2)."""
    norm_unit_offset: bool = False
    """With flavor = "llama": every RMSNorm scales by (1 + weight), its weights starting at 0 (Gemma)."""
    mlp_activation: str = "silu"
    """With flavor = "llama": the gate of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU: Gemma)."""
    embed_scale: bool = False
    """With flavor = "llama": token embeddings multiplied by sqrt(d_model) (Gemma)."""
    q_lora_rank: int = 0
    """With kv_lora_rank: rank of the queries' low-rank projection (DeepSeek's q_lora_rank); 0 = one full
    projection."""
    kv_lora_rank: int = 0
    """With flavor = "llama": multi-head latent attention (DeepSeek-V2/V3) with keys and values compressed to
    this rank; 0 = ordinary attention."""
    v_head_dim: int | None = None
    """With kv_lora_rank: width of each value head (DeepSeek's v_head_dim); default head_dim."""
    moe_dense_first: int = 0
    """With n_experts > 0: the first k blocks keep a dense MLP of d_ff (DeepSeek-V3's first_k_dense_replace)."""
    moe_groups: int = 1
    """With n_experts > 0: experts cut into this many groups; a token picks its experts in its moe_group_top_k
    best groups (DeepSeek-V3's n_group); 1 = no groups."""
    moe_group_top_k: int = 1
    """With moe_groups > 1: groups a token may pick experts from (DeepSeek-V3's topk_group)."""
    moe_gate_scale: float = 1.0
    """With n_experts > 0: the routed experts' gates multiplied by this (DeepSeek-V3's routed_scaling_factor)."""
    hf_model_type: str = ""
    """The transformers model_type `shardwise export --format hf` writes ("llama", "qwen2", "qwen3", "qwen3_moe",
    "mixtral", "mistral", "gemma2", "gemma3_text", "olmo2", "phi3", "deepseek_v3"); "" = the one the model's
    fields imply. model.init_from sets it from the directory's config.json."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """"stdlib" (the running Python's standard library .py files), or a path: a directory of text
    files, a .txt, .jsonl or .parquet file, or a Hugging Face dataset saved with save_to_disk."""
    format: str = "auto"
    """With a path as source: "auto" (by extension, or a directory's content), "text", "jsonl", "parquet" or "hf"."""
    text_field: str = "text"
    """With a jsonl, parquet or hf source: the field (jsonl) or column (parquet, hf) that holds the text."""
    tokenizer: str = "byte"
    """"byte" (UTF-8 bytes + end-of-text, no training), "bpe" (trained on the corpus with the
    tokenizers library and saved with the run), or a path to a tokenizer.json."""
    bpe_vocab_size: int = 4096
    """With tokenizer = "bpe": the vocabulary size to train."""
    seq_len: int | None = None
    """Tokens per training window; default model.max_seq_len."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation (chosen by a hash of the document name)."""
    max_bytes: int = 0
    """Read at most this many bytes of corpus text (0 = all)."""
    label_field: str = "label"
    """With train.objective = "classify": the jsonl field or parquet column holding each document's integer label."""
    cache_dir: str = ""
    """Where tokenized corpora are cached as memory-mapped arrays; default ~/.cache/shardwise."""


@dataclass
class TrainConfig:
    steps: int = 400
    """Optimizer steps."""
    global_batch: int | None = 32
    """Sequences per optimizer step = micro_batch * grad_accum * dp."""
    micro_batch: int | None = None
    """Sequences per forward/backward on one data-parallel rank."""
    grad_accum: int | None = None
    """Micro-batches accumulated per optimizer step. Any two of the three batch fields set the third."""
    lr: float = 4e-3
    """Peak learning rate (the default suits the small cpu-demo model; GPT-2 124M wants about 6e-4)."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; default lr / 10."""
    warmup_steps: int = 30
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (applied to matrices, not to norms, biases or position tables)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm (0 = no clipping)."""
    skip_grad_norm_above: float = 0.0
    """Skip, on every rank alike, an optimizer step whose pre-clip global gradient norm exceeds this (a guard
    against loss spikes); 0 = off. Steps with a non-finite loss or gradient are always skipped."""
    max_skipped_steps: int = 20
    """Stop the run after this many consecutive skipped steps (non-finite loss or gradient, fp16 overflow, a norm
    above skip_grad_norm_above), the newest checkpoint being an applied step's; 0 = never stop. The default
    exceeds the 16 back-offs of fp16's loss scale from 2^16 down to 1."""
    seed: int = 1337
    """Seeds weight initialisation, data order and dropout; the same for every layout."""
    precision: str = "bf16"
    """"fp32", "bf16" (autocast) or "fp16" (autocast with a dynamic loss scaler). Master weights are fp32."""
    fp16_init_scale: float = 2.0**16
    """With precision = "fp16": the initial loss scale."""
    fp16_growth_interval: int = 2000
    """With precision = "fp16": steps without overflow after which the loss scale doubles."""
    recompute: str = "none"
    """Activation checkpointing: "none", "full" (recompute whole blocks in backward) or "selective"
    (recompute only each block's attention core, Korthikanti et al. 2022 §5)."""
    recompute_every: int = 1
    """With recompute = "full": checkpoint every k-th block (1 = every block)."""
    compile: bool = False
    """Compile each transformer block's forward with torch.compile (after tensor parallelism and
    recompute; state dicts unchanged). The first step pays the compilation."""
    eval_every: int = 50
    """Validation loss every N steps (and at the end; 0 = only at the end)."""
    eval_batches: int = 8
    """Size of the validation set in global batches: the first eval_batches * global_batch held-out windows,
    the same set whatever the layout, split over the data-parallel ranks."""
    objective: str = "causal"
    """"causal" (next-token prediction: gpt2, llama), "mlm" (masked language modelling, Devlin et al. 2019
    §3.1: 15 % of the tokens of each window chosen, 80 % replaced by [MASK], 10 % by a random token, 10 % kept)
    or "classify" (one label per document of a jsonl / parquet source, [CLS] classifier); mlm and classify: bert."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU; 0 = look up the GPU, or measure a matmul on CPU."""


@dataclass
class ParallelConfig:
    nproc: int | None = None
    """Worker processes on this machine; default the number of GPUs, or 2 without a GPU."""
    nnodes: int = 1
    """Machines. With nnodes > 1 run the same `shardwise train` on every node with rdzv_endpoint and a shared
    run.dir (torchrun's c10d rendezvous; see shardwise.dist.nodes)."""
    rdzv_endpoint: str = ""
    """With nnodes > 1: HOST:PORT of the rendezvous, an address of one of the nodes (which hosts it)."""
    rdzv_timeout_s: float = 120.0
    """With nnodes > 1: seconds to reach the rendezvous endpoint and for all nnodes nodes to join it."""
    dp: int | None = None
    """Data-parallel size; default world size / (tp * pp * cp)."""
    tp: int = 1
    """Tensor-parallel size (shardwise.parallel.tensor): heads, the MLP width and the vocabulary split over tp
    ranks (Megatron-LM); with sequence_parallel also the sequence outside those regions."""
    pp: int = 1
    """Pipeline-parallel stages (shardwise.parallel.pipeline); the model's blocks are split among them."""
    cp: int = 1
    """Context-parallel size: the sequence of every layer split over cp ranks (shardwise.parallel.context)."""
    cp_algorithm: str = "ring"
    """With cp > 1: "ring" (ring attention, K/V rotate by isend/irecv), "allgather" (K/V gathered) or
    "ulysses" (all-to-all from sequence- to head-sharded; heads must divide by cp)."""
    cp_balance: str = "headtail"
    """With cp > 1: "headtail" (2*cp chunks, rank r holds r and 2cp-1-r: equal causal work) or "none"
    (contiguous)."""
    ep: int = 1
    """Expert-parallel size (shardwise.parallel.expert): experts split over runs of ep data-parallel ranks;
    must divide model.n_experts and parallel.dp."""
    ep_dispatch: str = "exchange"
    """With ep > 1: how tokens reach their experts. "exchange": the counts per expert are exchanged, then the
    kept tokens move by an all-to-all of uneven splits (dropless or not; the host reads the splits: one host
    synchronisation per MoE layer); "padded": every rank sends each expert exactly its capacity of rows, pads
    included (needs model.moe_capacity_factor > 0; no host synchronisation, E x C rows computed;
    shardwise.parallel.expert.padded)."""
    etp: int = 1
    """Expert tensor parallelism (shardwise.parallel.expert.tensor): 1 keeps every expert whole on each tp rank;
    parallel.tp splits each expert's hidden units over the tp ranks, as Megatron-Core's expert tensor parallel
    size (other values, Megatron's "parallel folding", are not built)."""
    zero: int = 0
    """ZeRO stage (Rajbhandari et al. 2020): 0 = plain data parallel, 1 = shard optimizer states,
    2 = also gradients, 3 = also parameters (shardwise.parallel.zero)."""
    zero_unit: int = 1
    """With zero = 3: transformer blocks per sharding unit (gathered and freed together)."""
    zero_param_dtype: str = "fp32"
    """With zero >= 1 and train.precision = "bf16": "bf16" keeps the flat parameters, gradients and their
    communication in bf16 beside fp32 master weights (the mixed-precision training the ZeRO paper counts,
    Rajbhandari et al. 2020 §3.1; with parallel.offload the masters and moments live on the host);
    "fp32" keeps the model's fp32 weights as the masters."""
    offload: str = "none"
    """With zero >= 1: where fp32 master weights and optimizer states live and are stepped:
    "none", "cpu" (ZeRO-Offload) or "disk" (memory-mapped files under offload_dir)."""
    offload_dir: str = ""
    """With offload = "disk": directory for the memory-mapped files; default RUN_DIR/offload."""
    zero_quant_weights: bool = False
    """With zero = 3: all-gather parameters as int8 blocks (ZeRO++ qwZ); lossy."""
    zero_quant_grads: bool = False
    """With zero >= 1: reduce-scatter gradients as int8 blocks via all-to-all (ZeRO++ qgZ); lossy."""
    zero_hpz: int = 1
    """With zero = 3: ranks per node for ZeRO++ hierarchical partitioning (hpZ): a secondary copy of
    each unit's parameters sharded over that many consecutive dp ranks keeps backward gathers
    inside the node; exact. 1 = off; must divide parallel.dp."""
    zero_overlap_param_gather: bool = True
    """With zero = 1 or 2: launch the all-gather of the updated parameters after the optimizer step without
    waiting; each module's forward pre-hook waits only for the units holding its own parameters, so the
    next forward (a pipeline's first micro-batch) runs beside the gathers of later layers (Megatron-Core's
    --overlap-param-gather). Exact; false waits for every gather before the next forward."""
    zero_overlap_grad_reduce: bool = True
    """With zero = 1 or 2: reduce-scatter each gradient bucket as soon as the last micro-batch's backward has
    completed it, beside the rest of backward, on every device (gloo: the direct exchange's messages travel
    on gloo's transport threads), and inside a pipeline during each chunk's last backward where the schedule
    allows (not zb-h1); Megatron-Core's --overlap-grad-reduce. Exact; false waits for each reduce-scatter
    at once (pipelines: reduce after the flush)."""
    grad_reduce_dtype: str = "auto"
    """The dtype gradients travel in when they are averaged over the data-parallel group, plain all-reduce or
    ZeRO's reduce-scatter (FSDP2's reduce_dtype): "auto" (the gradients' own: fp32, or bf16 under
    zero_param_dtype = "bf16"), "fp32" or "bf16" (half the bytes; lossy). Only the communication is cast:
    micro-batches accumulate and the optimizer steps in the gradients' own dtype."""
    tp_comm_overlap: bool = False
    """With tp > 1: overlap tensor- and sequence-parallel communication with the matmul next to it by
    decomposition (Wang et al. 2022): the sequence all-gather before a column-parallel projection and the
    reduce-scatter (all-reduce without sequence parallelism) after a row-parallel one are cut into tp chunks,
    chunk k travelling while chunk k-1 is multiplied (shardwise.parallel.tensor.overlap). Equal within
    rounding (the matmuls are cut by rows)."""
    pp_schedule: str = "1f1b"
    """With pp > 1: "naive", "gpipe", "1f1b", "interleaved" (with pp_virtual >= 2 chunks per rank) or "zb-h1"."""
    microbatches: int | None = None
    """With pp > 1: pipeline micro-batches per step and replica (= train.grad_accum; the micro-batches
    of a step flow through the pipeline); default the largest of 4*pp, 2*pp, pp that divides the batch.
    With pp = 1 it is refused: micro-batches accumulated per step are train.grad_accum."""
    pp_virtual: int = 1
    """With pp_schedule = "interleaved": model chunks per pipeline rank (v)."""
    pp_partition: str = "params"
    """With pp > 1: how blocks are split into stages: "even", "params" or "flops" (balanced by that
    cost, embedding and head included), or the first block of every stage after the first ("2,5")."""
    pp_embedding_slot: bool = False
    """With pp_partition = "even": the embedding takes one block's place in the split, so the first stage
    holds one block fewer (Megatron-LM's --account-for-embedding-in-pipeline-split; Llama 3 §3.3.2); a stage
    may then hold the embedding alone. E.g. 126 layers on pp 16 with both slots: 8 places per stage."""
    pp_head_slot: bool = False
    """With pp_partition = "even": the output layer and loss take one block's place on the last stage
    (Megatron-LM's --account-for-loss-in-pipeline-split; Llama 3 §3.3.2)."""
    sequence_parallel: bool = False
    """With tp > 1: also split the sequence over the tensor-parallel ranks outside the attention and MLP regions
    (norms, dropout, residuals; Korthikanti et al. 2022 §4.2.2): f and g become all-gather and reduce-scatter."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (data parallel, pipeline, ZeRO-1/2; ZeRO-3 reduces per zero_unit)."""
    backend: str = "auto"
    """"auto" (nccl with GPUs, gloo otherwise), "nccl" or "gloo"."""
    timeout_s: float = 600.0
    """A collective that waits longer than this fails instead of hanging."""


@dataclass
class CommConfig:
    algorithm: str = "native"
    """Data-parallel gradient all-reduce algorithm (ZeRO reduces with the backend's own; only "native"):
    "native" (the backend's own), "auto" (the calibrated cost model picks per bucket size), or one of
    ours: "naive", "star", "ring", "rabenseifner", "recursive_doubling", "tree", "hierarchical", "torus".
    With compression "int8" / "topk" (an all-to-all and an all-gather): "native" or "ring" (ours).
    With parallel.ep > 1 it also picks the experts' all-to-all: "native" the backend's, any other ours (pairwise)."""
    compression: str = "none"
    """Data-parallel gradient compression (ZeRO: parallel.zero_quant_grads): "none", "fp16", "bf16"
    (cast), "int8" (per-chunk absmax, error feedback) or "topk" (sparsification, error feedback)."""
    topk_ratio: float = 0.01
    """With compression = "topk": fraction of gradient entries sent each step, in (0, 1]."""
    node_size: int = 0
    """With algorithm "hierarchical", "torus" or "auto": ranks per node for "hierarchical" (0: 2) and
    row length for "torus" (0: most square grid); with "auto", 0 takes the node size of the group, from
    the launcher's ranks per node (parallel.nproc), for the two-level cost model and what it picks."""
    timeout_s: float = 0.0
    """With an algorithm other than "native": seconds our collectives wait for a peer before failing
    with an error naming the collective (0: the process group's parallel.timeout_s, which alone bounds
    the backend's own collectives)."""


@dataclass
class PsConfig:
    servers: int = 0
    """Parameter-server ranks S (shardwise.ps): the last S ranks serve key ranges of the model and apply
    AdamW, the other ranks are workers over which the data is sharded; 0 = off (all-reduce data parallel)."""
    consistency: str = "bsp"
    """With servers >= 1: "bsp" (a pull of clock c waits for every worker's clock c - 1: synchronous data
    parallelism), "ssp" (bounded staleness, Ho et al. 2013) or "asp" (every push applied on arrival)."""
    staleness: int = 0
    """With consistency = "ssp": the bound s; a worker at clock c waits until every update of clocks
    <= c - s - 1 is applied (s = 0 is bsp)."""
    partition_kb: int = 4000
    """With servers >= 1: largest partition in KiB (1024 bytes of fp32) each tensor is cut into
    (BytePS's default 4,096,000 bytes); partitions go to servers by key range."""
    scheduling: str = "fifo"
    """With servers >= 1: order of pushes started from gradient hooks during backward: "fifo" (as ready)
    or "priority" (layers nearest the input first, under ps.credit_kb; ByteScheduler / P3)."""
    credit_kb: int = 4000
    """With scheduling = "priority": KiB of pushes in flight at once (the credit of ByteScheduler)."""
    straggler: str = ""
    """With servers >= 1: "RANK:MS" delays worker RANK by MS milliseconds per step (experiments); "" = none."""


@dataclass
class CkptConfig:
    every: int = 100
    """Save a checkpoint every N steps (0 = only at the end)."""
    keep: int = 2
    """Keep the newest K checkpoints."""
    resume: bool = False
    """Continue from the newest valid checkpoint in run.dir/checkpoints."""
    async_: bool = False
    """Written ``ckpt.async`` (``async`` is a Python keyword): write checkpoints in the background -- every rank
    copies its pieces to host memory and trains on while a thread writes them, at most one write in flight."""


@dataclass
class RunConfig:
    dir: str = ""
    """Run directory; default runs/<preset>-<date>-<time> (with runs/latest pointing at it)."""
    device: str = "auto"
    """"auto" (cuda if available), "cpu" (gloo workers, 2 by default) or "cuda" (nccl, one worker per GPU;
    with parallel.backend gloo: CUDA tensors on gloo, for the collectives gloo has on CUDA)."""
    progress: bool = True
    """Show a progress bar on the terminal."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    max_restarts: int | None = None
    """Times torch's elastic agent restarts the whole group after a worker fails (crash, kill, hang past the
    timeouts); each restart resumes from the newest valid checkpoint. Default 3 with ckpt.every > 0, else 0."""
    fault: str = ""
    """For failover tests only: failures to inject, "KIND@STEP:rRANK,..." (the i-th in restart attempt i;
    KIND kill, stop, hang, save or raise), see shardwise.train.faults. Empty (the default): none."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> Config:
        cfg = cls()
        for section, values in tree.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{section}: expected a [section] table, got {values!r}")
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value)
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, overrides: dict[str, str] | None = None,
             other_tables: tuple[str, ...] = ()) -> Config:
        """Read a TOML file (if given), then apply ``{"section.key": "text value"}`` overrides. ``other_tables``:
        top-level tables of the file that belong to a command, not to the config tree (e.g. the planner's)."""
        tree: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {str(p)!r} does not exist")
            try:
                tree = tomllib.loads(p.read_text())
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        cfg = cls.from_dict({k: v for k, v in tree.items() if k not in other_tables})
        for dotted, text in (overrides or {}).items():
            cfg.set_text(dotted, text)
        return cfg

    def set(self, dotted: str, value: Any) -> None:
        """Set one field by dotted name, converting and checking the type."""
        hint = self._hint(dotted)
        section_name, _, key = dotted.partition(".")
        section = getattr(self, section_name)
        setattr(section, attribute(key), _coerce(dotted, value, hint))

    def set_text(self, dotted: str, text: str) -> None:
        """Set one field from command-line text, as the same value written in TOML would set it.

        A string-typed field takes the text verbatim ("none" stays "none", "1e3" stays "1e3");
        other fields parse it as a TOML value (:func:`parse_value`)."""
        hint = self._hint(dotted)
        is_text = str in (typing.get_args(hint) or (hint,))
        self.set(dotted, text if is_text and isinstance(text, str) else parse_value(text))

    def _hint(self, dotted: str) -> Any:
        """The type of the field ``dotted``, or ConfigError naming the nearest key."""
        section_name, _, key = dotted.partition(".")
        sections = {f.name for f in dataclasses.fields(self)}
        if section_name not in sections or not key:
            raise ConfigError(f"unknown config key {dotted!r}{_suggest(section_name, sections)}")
        hints = typing.get_type_hints(type(getattr(self, section_name)))
        if attribute(key) not in hints:
            names = [f"{section_name}.{key_name(n)}" for n in hints]
            raise ConfigError(f"unknown config key {dotted!r}{_suggest(dotted, names)}")
        return hints[attribute(key)]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The tree as plain data, under the names files and the command line use (``ckpt.async``)."""
        return {s: {key_name(k): v for k, v in vals.items()} for s, vals in dataclasses.asdict(self).items()}

    def to_toml(self) -> str:
        """The tree as TOML; unset (None) fields are left out, as TOML has no null."""
        import tomli_w

        tree = {s: {k: v for k, v in vals.items() if v is not None} for s, vals in self.to_dict().items()}
        return tomli_w.dumps(tree)


def attribute(key: str) -> str:
    """The dataclass attribute of a config key: a Python keyword takes a trailing underscore (PEP 8), so
    ``ckpt.async`` is ``CkptConfig.async_``; ``async_`` itself is accepted too."""
    return f"{key}_" if keyword.iskeyword(key) else key


def key_name(attr: str) -> str:
    """The config key of a dataclass attribute (the inverse of :func:`attribute`)."""
    return attr[:-1] if attr.endswith("_") and keyword.iskeyword(attr[:-1]) else attr


# ---- value parsing -------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """Turn a command-line string into a TOML-like value: 3 -> int, 1e-3 -> float, true -> bool;
    anything else stays a string ("none" too: only a field that may be unset takes it as None)."""
    if not isinstance(text, str):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


NONE_WORDS = ("none", "null")
"""Text that unsets a field whose type allows None (``--train.global_batch none``)."""


def _coerce(dotted: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    allowed = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if isinstance(value, str) and value.strip().lower() in NONE_WORDS and type(None) in allowed:
        return None  # TOML has no null: "none" unsets a field that may be unset (never a str field's "none")
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{dotted}=None is not allowed; give {_type_name(allowed)}")
    for t in allowed:
        if t is type(None):
            continue
        if t is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
        elif t is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif t is str:
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
    raise ConfigError(f"{dotted}={shown(value)} is not {_type_name(allowed)}")


def shown(value: Any) -> str:
    """A value as a user writes it in TOML or on the command line (``true``, ``'text'``, ``3``), not as Python
    prints it (``True``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text"}


def _type_name(types_: tuple) -> str:
    names = [getattr(t, "__name__", str(t)) for t in types_ if t is not type(None)]
    return " or ".join(_TYPE_WORDS.get(n, f"a {n}") for n in names)


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"
