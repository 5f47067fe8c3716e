"""Resolution and validation of the config tree: derived fields filled, every section checked.

:meth:`shardwise.config.Config.resolve` copies the tree and calls :func:`resolve_config`, which runs
the section resolvers in dependency order: the model (preset sizes, vocabulary), the data, the device
and backend, the parallel axes (``dp`` from the world size), the batch arithmetic
(``global = micro * accum * dp``; with a pipeline, its micro-batches are the accumulation), the
pipeline checks that need no processes, the training hyper-parameters, and last any field set away
from its default that the resolved layout would not read (:func:`_refuse_unused`). Each raises
:class:`~shardwise.config.ConfigError` naming the dotted field, its value and what would be valid,
so bad input fails before any worker starts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shardwise.config import (
    CHOICES,
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from shardwise.model.presets import PRESETS


def resolve_config(cfg: Config, world_size: int | None = None, tokenizer_vocab: int | None = None) -> None:
    """Fill the derived fields of ``cfg`` (a copy the caller owns) in place, or raise ConfigError."""
    resolve_model(cfg.model, tokenizer_vocab)
    _resolve_data(cfg)
    _resolve_device(cfg.run, cfg.parallel)
    _resolve_parallel(cfg.parallel, world_size)
    _default_microbatches(cfg.parallel, cfg.train)
    _resolve_batch(cfg.train, cfg.parallel.dp)
    _resolve_pipeline(cfg)
    _resolve_tensor_parallel(cfg)
    _resolve_experts(cfg)
    _validate_train(cfg.train)
    _validate_misc(cfg)
    _refuse_unused(cfg)


def _choice(dotted: str, value: Any, options: tuple | None = None) -> None:
    """``value`` must be one of ``options`` (default: ``CHOICES[dotted]``)."""
    options = CHOICES[dotted] if options is None else options
    if value not in options:
        raise ConfigError(f"{dotted}={value!r} is not valid; use one of {', '.join(map(repr, options))}")


def _positive(dotted: str, value: float | int | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if (value < 0) or (value == 0 and not allow_zero) or (isinstance(value, float) and not math.isfinite(value)):
        what = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{dotted}={value!r} must be {what} number")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_model(m: ModelConfig, tokenizer_vocab: int | None) -> None:
    shape = (m.n_layers, m.d_model, m.n_heads)
    if m.preset == "cpu-demo" and m.max_seq_len is None and None not in shape and \
            shape != tuple(PRESETS["cpu-demo"][k] for k in ("n_layers", "d_model", "n_heads")):
        # a shape of its own under the default preset: a custom model, whose max_seq_len follows
        # data.seq_len rather than cpu-demo's 128 (a resolved config has max_seq_len: it stays as it is)
        m.preset, m.flavor = "custom", m.flavor or "gpt2"
    _choice("model.preset", m.preset)
    for key, value in PRESETS.get(m.preset, {}).items():
        if getattr(m, key) is None:
            setattr(m, key, value)
    _choice("model.flavor", m.flavor)
    for key in ("n_layers", "d_model", "n_heads"):
        if getattr(m, key) is None:
            raise ConfigError(f"model.{key} is not set; give it or choose a model.preset")
        _positive(f"model.{key}", getattr(m, key))
    if m.n_kv_heads is None:
        m.n_kv_heads = m.n_heads
    _positive("model.n_kv_heads", m.n_kv_heads)
    if m.d_model % m.n_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}; use one of {_divisors(m.d_model)}"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}; "
            f"use one of {_divisors(m.n_heads)}"
        )
    if m.flavor == "gpt2" and m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: the gpt2 flavor has no grouped-query attention; "
                          f"use {m.n_heads} or model.flavor='llama'")
    if m.flavor == "llama" and (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.d_model/model.n_heads={m.d_model // m.n_heads} must be even for rotary embeddings")
    if m.d_ff is None:
        m.d_ff = 4 * m.d_model if m.flavor == "gpt2" else 64 * math.ceil(8 * m.d_model / 3 / 64)
    _positive("model.d_ff", m.d_ff)
    if m.tie_embeddings is None:
        m.tie_embeddings = m.flavor == "gpt2"
    if m.vocab_size is None:
        m.vocab_size = tokenizer_vocab
    elif tokenizer_vocab is not None and m.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}); "
            f"use at least {tokenizer_vocab} or leave it unset"
        )
    _positive("model.vocab_size", m.vocab_size)
    _positive("model.max_seq_len", m.max_seq_len)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)
    _resolve_moe(m)


def _resolve_moe(m: ModelConfig) -> None:
    """The mixture-of-experts fields (shardwise.model.moe): sizes and coefficients in range."""
    if m.n_experts is None:
        m.n_experts = 0
    _positive("model.n_experts", m.n_experts, allow_zero=True)
    if m.n_experts and not 1 <= m.moe_top_k <= m.n_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in 1..model.n_experts={m.n_experts}")
    _positive("model.moe_every", m.moe_every)
    if m.n_experts and m.moe_every > m.n_layers:
        raise ConfigError(f"model.moe_every={m.moe_every} exceeds model.n_layers={m.n_layers}: no block would be "
                          f"MoE; use 1..{m.n_layers}")
    for key in ("moe_shared", "moe_capacity_factor", "moe_aux_coeff", "moe_z_coeff"):
        _positive(f"model.{key}", getattr(m, key), allow_zero=True)


def _resolve_data(cfg: Config) -> None:
    d, m = cfg.data, cfg.model
    _choice("data.format", d.format)
    if d.source != "stdlib" and not Path(d.source).exists():
        raise ConfigError(f"data.source={d.source!r} does not exist; give a file or directory, or 'stdlib'")
    if d.tokenizer not in CHOICES["data.tokenizer"] and not Path(d.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is neither 'byte', 'bpe' nor an existing tokenizer.json")
    if d.tokenizer == "bpe" and d.bpe_vocab_size < 260:
        raise ConfigError(f"data.bpe_vocab_size={d.bpe_vocab_size} is too small; use at least 260")
    if d.seq_len is None:
        d.seq_len = m.max_seq_len
    if d.seq_len is None:
        raise ConfigError("data.seq_len is not set and the model has no max_seq_len; give data.seq_len")
    _positive("data.seq_len", d.seq_len)
    if m.max_seq_len is None:
        m.max_seq_len = d.seq_len
    if d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; use at most {m.max_seq_len}"
        )
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _positive("data.max_bytes", d.max_bytes, allow_zero=True)


def _resolve_device(r: RunConfig, p: ParallelConfig) -> None:
    """run.device picks the backend (cpu: gloo, cuda: nccl) and the default number of workers."""
    _choice("run.device", r.device)
    _choice("parallel.backend", p.backend)
    if r.device == "cpu":
        if p.backend == "nccl":
            raise ConfigError("parallel.backend='nccl' needs GPUs but run.device='cpu'; use 'gloo' or 'auto'")
        p.backend = "gloo"
        if p.nproc is None:
            p.nproc = 2
    elif r.device == "cuda":
        if not _cuda_available():
            raise ConfigError("run.device='cuda' but no GPU is visible; use 'cpu' or 'auto'")
        if p.backend == "auto":
            p.backend = "nccl"


def _resolve_parallel(p: ParallelConfig, world_size: int | None) -> None:
    if p.nproc is None:
        p.nproc = default_nproc()
    _positive("parallel.nproc", p.nproc)
    _positive("parallel.nnodes", p.nnodes)
    world = world_size if world_size is not None else p.nproc * p.nnodes
    for axis in ("tp", "pp", "cp", "ep"):
        _positive(f"parallel.{axis}", getattr(p, axis))
    model_parallel = p.tp * p.pp * p.cp
    if p.dp is None:
        if world % model_parallel:
            raise ConfigError(
                f"parallel.tp*pp*cp={model_parallel} does not divide the world size {world}; "
                f"use a product among {_divisors(world)}"
            )
        p.dp = world // model_parallel
    _positive("parallel.dp", p.dp)
    if p.dp * model_parallel != world:
        raise ConfigError(
            f"parallel.dp*tp*pp*cp={p.dp * model_parallel} does not match the world size {world} "
            f"(parallel.nproc={p.nproc} x parallel.nnodes={p.nnodes}); set parallel.dp={world // model_parallel}"
            if world % model_parallel == 0
            else f"parallel.dp*tp*pp*cp={p.dp * model_parallel} does not match the world size {world}"
        )
    if p.cp != 1:
        raise ConfigError(f"parallel.cp={p.cp}: context parallelism is not implemented yet; use 1")
    if p.zero not in CHOICES["parallel.zero"]:
        raise ConfigError(f"parallel.zero={p.zero}: use 0 (off), 1, 2 or 3")
    if p.offload not in CHOICES["parallel.offload"]:
        raise ConfigError(f"parallel.offload={p.offload!r}: use 'none', 'cpu' or 'disk'")
    if p.offload != "none" and p.zero == 0:
        raise ConfigError(f"parallel.offload={p.offload!r} needs ZeRO; set parallel.zero to 1, 2 or 3")
    _positive("parallel.zero_unit", p.zero_unit)
    if p.zero_quant_weights and p.zero != 3:
        raise ConfigError(f"parallel.zero_quant_weights=true quantizes ZeRO-3's parameter gathers, "
                          f"but parallel.zero={p.zero}; set parallel.zero=3")
    if p.zero_quant_grads and p.zero == 0:
        raise ConfigError("parallel.zero_quant_grads=true needs ZeRO; set parallel.zero to 1, 2 or 3")
    _positive("parallel.zero_hpz", p.zero_hpz)
    if p.zero_hpz != 1 and p.zero != 3:
        raise ConfigError(f"parallel.zero_hpz={p.zero_hpz} partitions ZeRO-3's parameters within a node, "
                          f"but parallel.zero={p.zero}; set parallel.zero=3 or parallel.zero_hpz=1")
    if p.dp % p.zero_hpz:
        raise ConfigError(f"parallel.zero_hpz={p.zero_hpz} does not divide parallel.dp={p.dp}; "
                          f"use one of {_divisors(p.dp)}")
    _positive("parallel.bucket_mb", p.bucket_mb)
    _positive("parallel.timeout_s", p.timeout_s)


def _resolve_tensor_parallel(cfg: Config) -> None:
    """Tensor parallelism splits heads, the MLP width and the vocabulary (parallel/plan.py says how);
    sequence parallelism also splits the sequence over the same ranks."""
    from shardwise.parallel.plan import check_tensor_parallel

    p, m = cfg.parallel, cfg.model
    if p.tp > 1:
        try:
            check_tensor_parallel(m, p.tp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if m.dropout > 0:
            raise ConfigError(f"model.dropout={m.dropout} with parallel.tp={p.tp}: the tensor-parallel ranks would "
                              "draw correlated dropout masks (no per-rank RNG tracker yet); use model.dropout=0")
        if p.pp > 1 and p.sequence_parallel:
            raise ConfigError(f"parallel.sequence_parallel=true with parallel.pp={p.pp}: stages exchange whole-"
                              "sequence activations; sequence-split ones are not composed yet; use "
                              "parallel.sequence_parallel=false")
        if p.pp > 1 and p.pp_schedule == "zb-h1":
            raise ConfigError(f"parallel.pp_schedule='zb-h1' with parallel.tp={p.tp}: the zero-bubble schedule "
                              "defers nn.Linear weight gradients, not those of tensor-parallel layers; use '1f1b'")
        if p.zero and p.zero_hpz > 1:
            raise ConfigError(f"parallel.zero_hpz={p.zero_hpz} with parallel.tp={p.tp}: hpZ's node groups span "
                              "the whole world, not one tensor-parallel rank's replicas; use parallel.zero_hpz=1")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true splits the sequence over the tensor-parallel ranks, "
                          "but parallel.tp=1; set parallel.tp > 1 or parallel.sequence_parallel=false")
    if p.sequence_parallel and cfg.data.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel=true needs data.seq_len={cfg.data.seq_len} divisible by "
                          f"parallel.tp={p.tp}; use a multiple of {p.tp}")


def _resolve_experts(cfg: Config) -> None:
    """Expert parallelism (shardwise.parallel.expert) splits model.n_experts over runs of parallel.ep
    data-parallel ranks; what MoE does not compose with yet is refused here, one line each."""
    p, m = cfg.parallel, cfg.model
    if p.ep > 1 and not m.n_experts:
        raise ConfigError(f"parallel.ep={p.ep} needs a mixture-of-experts model; set model.n_experts "
                          "(a multiple of parallel.ep) or parallel.ep=1")
    if m.n_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.n_experts={m.n_experts}; "
                          f"use one of {_divisors(m.n_experts)}")
    if p.dp % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide parallel.dp={p.dp}; use one of {_divisors(p.dp)}")
    if m.n_experts and p.sequence_parallel:
        raise ConfigError(f"model.n_experts={m.n_experts} with parallel.sequence_parallel=true: MoE blocks stay whole "
                          "on every tensor-parallel rank and would see only their sequence shard (not composed "
                          "yet); use parallel.sequence_parallel=false")
    if m.n_experts and p.pp > 1:
        raise ConfigError(f"model.n_experts={m.n_experts} with parallel.pp={p.pp}: the auxiliary router losses "
                          "are added at the last stage only (not composed yet); use parallel.pp=1")
    if p.ep > 1 and p.zero:
        raise ConfigError(f"parallel.ep={p.ep} with parallel.zero={p.zero}: ZeRO does not shard expert weights "
                          "over their own replicas yet; use parallel.zero=0 (or parallel.ep=1)")


def _resolve_batch(t: TrainConfig, dp: int) -> None:
    """Solve global_batch = micro_batch * grad_accum * dp: any two of the three set the third."""
    for key in ("global_batch", "micro_batch", "grad_accum"):
        _positive(f"train.{key}", getattr(t, key))
    g, m, a = t.global_batch, t.micro_batch, t.grad_accum
    if g is None and (m is None or a is None):
        raise ConfigError("train.global_batch is not set; give it, or both train.micro_batch and train.grad_accum")
    if g is not None and m is None and a is None:
        a = 1
    if g is None:
        g = m * a * dp
    elif m is None:
        if g % (a * dp):
            raise ConfigError(
                f"train.global_batch={g} is not divisible by train.grad_accum*parallel.dp={a}*{dp}={a * dp}"
            )
        m = g // (a * dp)
    elif a is None:
        if g % (m * dp):
            raise ConfigError(
                f"train.global_batch={g} is not divisible by train.micro_batch*parallel.dp={m}*{dp}={m * dp}"
            )
        a = g // (m * dp)
    if m * a * dp != g:
        raise ConfigError(
            f"train.global_batch={g} != train.micro_batch*train.grad_accum*parallel.dp={m}*{a}*{dp}={m * a * dp}; "
            "set only two of the three"
        )
    t.global_batch, t.micro_batch, t.grad_accum = g, m, a


def _default_microbatches(p: ParallelConfig, t: TrainConfig) -> None:
    """With pp > 1 a step's micro-batches are the pipeline's: ``parallel.microbatches`` is ``train.grad_accum``.

    Unset, it is the largest of 4p, 2p, p (1 for "naive") that divides the replica's batch: the bubble
    (p - 1) / (m + p - 1) shrinks with m (Narayanan et al. 2021 §2.2.1)."""
    if p.pp == 1:
        return
    m = p.microbatches
    if m is not None:
        _positive("parallel.microbatches", m)
        if t.grad_accum is not None and t.grad_accum != m:
            raise ConfigError(f"train.grad_accum={t.grad_accum} != parallel.microbatches={m}: with parallel.pp > 1 "
                              "the micro-batches of a step are the pipeline's; set only one of them")
        t.grad_accum = m
    elif t.grad_accum is None and t.micro_batch is None and t.global_batch is not None \
            and t.global_batch % p.dp == 0:
        replica = t.global_batch // p.dp
        options = [1] if p.pp_schedule == "naive" else [4 * p.pp, 2 * p.pp, p.pp, 1]
        t.grad_accum = next(c for c in options if replica % c == 0)


def _resolve_pipeline(cfg: Config) -> None:
    """Pipeline checks that need no processes (stages vs layers, schedule vs micro-batches), before spawning."""
    p = cfg.parallel
    _positive("parallel.pp_virtual", p.pp_virtual)
    _choice("parallel.pp_schedule", p.pp_schedule)
    method, boundaries = pipeline_partition(p.pp_partition)
    if p.pp == 1:
        if p.pp_virtual != 1:
            raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp > 1; use 1")
        return
    p.microbatches = cfg.train.grad_accum
    if p.zero > 1:
        raise ConfigError(f"parallel.zero={p.zero} with parallel.pp={p.pp}: a pipeline keeps every micro-batch's "
                          "gradients until the flush, so only ZeRO-1 (sharded optimizer states) composes with it "
                          "here; use parallel.zero=1 or 0")
    if p.zero and (p.pp_virtual > 1 or p.pp_schedule == "zb-h1"):
        raise ConfigError(f"parallel.zero=1 with parallel.pp_schedule={p.pp_schedule!r} and parallel.pp_virtual="
                          f"{p.pp_virtual}: ZeRO-1 wraps one stage per rank, and zb-h1's deferred weight gradients "
                          "bypass its hooks; use '1f1b' or 'gpipe' with parallel.pp_virtual=1")
    if p.zero and (p.offload != "none" or p.zero_quant_grads):
        raise ConfigError("parallel.zero=1 inside a pipeline runs without offload or int8 gradients for now; "
                          "use parallel.offload='none' and parallel.zero_quant_grads=false")
    from shardwise.parallel.pipeline import check_pipeline, partition

    try:
        check_pipeline(cfg.model.n_layers, p.pp, p.pp_schedule, p.microbatches,
                       cfg.train.micro_batch * p.microbatches, p.pp_virtual)
        if method == "manual":  # a cost-balanced split always exists once there are enough layers
            partition(cfg.model, p.pp * p.pp_virtual, method, boundaries)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def pipeline_partition(text: str) -> tuple[str, list[int] | None]:
    """``parallel.pp_partition`` as ``(method, boundaries)``: a method name, or "2,5" -> ("manual", [2, 5])."""
    text = str(text).strip()
    if text and all(part.strip().isdigit() for part in text.split(",")):
        return "manual", [int(part) for part in text.split(",")]
    if text not in CHOICES["parallel.pp_partition"]:
        raise ConfigError(f"parallel.pp_partition={text!r} is not valid; use 'even', 'params', 'flops' "
                          "or the first block of each stage after the first, e.g. '2,5'")
    return text, None


def _validate_train(t: TrainConfig) -> None:
    _positive("train.steps", t.steps)
    _positive("train.lr", t.lr)
    if t.min_lr is None:
        t.min_lr = t.lr / 10
    _positive("train.min_lr", t.min_lr, allow_zero=True)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} exceeds train.lr={t.lr}")
    _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    _positive("train.weight_decay", t.weight_decay, allow_zero=True)
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be in [0, 1)")
    _positive("train.eps", t.eps)
    _positive("train.grad_clip", t.grad_clip, allow_zero=True)
    _choice("train.precision", t.precision)
    _positive("train.fp16_init_scale", t.fp16_init_scale)
    _positive("train.fp16_growth_interval", t.fp16_growth_interval)
    _choice("train.recompute", t.recompute)
    _positive("train.recompute_every", t.recompute_every)
    _positive("train.eval_every", t.eval_every, allow_zero=True)
    _positive("train.eval_batches", t.eval_batches)
    _positive("train.peak_flops", t.peak_flops, allow_zero=True)


def _validate_misc(cfg: Config) -> None:
    _choice("comm.algorithm", cfg.comm.algorithm)
    _choice("comm.compression", cfg.comm.compression)
    if not 0 < cfg.comm.topk_ratio <= 1:
        raise ConfigError(f"comm.topk_ratio={cfg.comm.topk_ratio} is not valid; use a fraction in (0, 1]")
    _positive("comm.node_size", cfg.comm.node_size, allow_zero=True)
    _positive("comm.timeout_s", cfg.comm.timeout_s, allow_zero=True)
    _positive("ckpt.every", cfg.ckpt.every, allow_zero=True)
    _positive("ckpt.keep", cfg.ckpt.keep)


def _refuse_unused(cfg: Config) -> None:
    """Refuse a field set (away from its default) that the resolved layout never reads, naming what would
    read it: a setting that silently does nothing misleads. Rules run in order; the first that fails is
    reported, so a cause (comm.compression under ZeRO) is named before its consequences (comm.topk_ratio)."""
    m, d, t, p, c = cfg.model, cfg.data, cfg.train, cfg.parallel, cfg.comm
    zero = f"ZeRO (parallel.zero={p.zero})"
    own = "shardwise's own collective algorithms"
    rules = [  # (dotted field, read in this layout?, why not and what to do instead)
        ("model.rope_theta", m.flavor == "llama", f"sets rotary embeddings, which model.flavor={m.flavor!r} "
         "does not use; use model.flavor='llama' or remove it"),
        *((f"model.{k}", m.n_experts > 0, "configures mixture-of-experts blocks, but model.n_experts=0; set "
           "model.n_experts or remove it") for k in ("moe_top_k", "moe_every", "moe_shared", "moe_capacity_factor",
                                                     "moe_aux_coeff", "moe_z_coeff")),
        ("data.format", d.source != "stdlib", "describes a data.source file or directory, but data.source='stdlib' "
         "is the standard library's .py files; give data.source a path or remove it"),
        ("data.text_field", _source_kind(d) not in ("stdlib", "text"), f"names a jsonl field or a parquet / hf "
         f"column, but data.source={d.source!r} is read as plain text; remove it or give such a data.source"),
        ("data.bpe_vocab_size", d.tokenizer == "bpe",
         f"sizes a trained BPE tokenizer, but data.tokenizer={d.tokenizer!r}; set data.tokenizer='bpe' or remove it"),
        ("train.recompute_every", t.recompute == "full", f"applies to train.recompute='full', but train.recompute="
         f"{t.recompute!r}; set train.recompute='full' or remove it"),
        ("train.fp16_init_scale", t.precision == "fp16", f"configures the fp16 loss scaler, but train.precision="
         f"{t.precision!r} has none; set train.precision='fp16' or remove it"),
        ("train.fp16_growth_interval", t.precision == "fp16", f"configures the fp16 loss scaler, but "
         f"train.precision={t.precision!r} has none; set train.precision='fp16' or remove it"),
        ("parallel.microbatches", p.pp > 1, f"counts a pipeline's micro-batches, but parallel.pp=1; use "
         f"train.grad_accum={p.microbatches} for micro-batches accumulated per step"),
        ("parallel.pp_schedule", p.pp > 1, "orders a pipeline's stages, but parallel.pp=1; set parallel.pp > 1 or "
         "remove it"),
        ("parallel.pp_partition", p.pp > 1, "splits the model into pipeline stages, but parallel.pp=1; "
         "set parallel.pp > 1 or remove it"),
        ("parallel.zero_unit", p.zero == 3, f"groups ZeRO-3's parameter gathers, but parallel.zero={p.zero}; "
         "set parallel.zero=3 or remove it"),
        ("parallel.bucket_mb", p.zero != 3, "sizes gradient buckets, but ZeRO-3 (parallel.zero=3) gathers and "
         "reduces whole units; set parallel.zero_unit (blocks per unit) instead"),
        ("parallel.offload_dir", p.offload == "disk", f"is where parallel.offload='disk' writes, but "
         f"parallel.offload={p.offload!r}; set parallel.offload='disk' or remove it"),
        ("comm.algorithm", not p.zero, f"applies to the data-parallel all-reduce; {zero} reduces with the "
         "backend's reduce-scatter and all-gather; use comm.algorithm='native'"),
        ("comm.compression", not p.zero, f"applies to the data-parallel all-reduce; {zero} reduces with the "
         "backend's reduce-scatter; use parallel.zero_quant_grads for compressed ZeRO gradients"),
        ("comm.timeout_s", not p.zero, f"bounds {own}; {zero} runs the backend's collectives, which "
         "parallel.timeout_s bounds; set parallel.timeout_s instead"),
        ("comm.algorithm", c.compression not in ("int8", "topk") or c.algorithm == "ring",
         f"is an all-reduce algorithm, but comm.compression={c.compression!r} sends an all-to-all and an all-gather "
         "instead; use comm.algorithm='native' (the backend's) or 'ring' (ours)"),
        ("comm.timeout_s", c.algorithm != "native", f"bounds {own}, but comm.algorithm='native' runs the backend's, "
         "which parallel.timeout_s bounds; set parallel.timeout_s instead, or another comm.algorithm"),
        ("comm.topk_ratio", c.compression == "topk", f"applies to comm.compression='topk', but comm.compression="
         f"{c.compression!r}; set comm.compression='topk' or remove it"),
        ("comm.node_size", c.algorithm in ("hierarchical", "torus", "auto"), f"shapes the 'hierarchical' and "
         f"'torus' all-reduce (and what 'auto' picks), but comm.algorithm={c.algorithm!r}; remove it"),
    ]
    for dotted, read, why in rules:
        value = _field(cfg, dotted)
        if not read and value != _field(DEFAULTS, dotted):
            raise ConfigError(f"{dotted}={value!r} {why}")


DEFAULTS = Config()
"""The tree as constructed: a field equal to its default here counts as not set."""


def _field(cfg: Config, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def _source_kind(d) -> str | None:
    """What ``data.source`` is read as ("stdlib", "text", "jsonl", "parquet", "hf"); only computed when
    ``data.text_field`` is set, as a directory's format is found by scanning it. None: unknown."""
    if d.text_field == DEFAULTS.data.text_field:
        return None
    from shardwise.data.sources import DataError, open_source

    try:
        return open_source(d.source, d.format).kind
    except DataError:
        return None  # the data layer names the problem when it reads the source


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_nproc() -> int:
    """The number of GPUs, or 2 CPU workers when there is none."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2
