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
    _resolve_parallel(cfg.parallel, _ps_world(cfg, world_size))
    _default_microbatches(cfg.parallel, cfg.train)
    _resolve_batch(cfg.train, cfg.parallel.dp)
    _resolve_pipeline(cfg)
    _resolve_tensor_parallel(cfg)
    _resolve_context_parallel(cfg)
    _resolve_objective(cfg)
    _resolve_experts(cfg)
    _validate_train(cfg.train)
    _check_zero_param_dtype(cfg)
    _validate_misc(cfg)
    _resolve_ps(cfg)
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
    if m.init_from:
        _apply_init_from(m)
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
    if m.flavor in ("gpt2", "bert") and m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: the {m.flavor} flavor has no grouped-query attention; "
                          f"use {m.n_heads} or model.flavor='llama'")
    if m.flavor == "llama" and (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.d_model/model.n_heads={m.d_model // m.n_heads} must be even for rotary embeddings")
    if m.d_ff is None:
        m.d_ff = 4 * m.d_model if m.flavor in ("gpt2", "bert") else 64 * math.ceil(8 * m.d_model / 3 / 64)
    _positive("model.d_ff", m.d_ff)
    if m.tie_embeddings is None:
        m.tie_embeddings = m.flavor in ("gpt2", "bert")
    if m.flavor == "bert" and tokenizer_vocab is not None:  # [PAD], [CLS], [MASK] past the tokenizer's ids
        if m.vocab_size is None:
            m.vocab_size = tokenizer_vocab + 3
        elif m.vocab_size < tokenizer_vocab + 3:
            raise ConfigError(f"model.vocab_size={m.vocab_size} leaves no ids for bert's [PAD], [CLS] and [MASK] "
                              f"after the tokenizer's {tokenizer_vocab}; use at least {tokenizer_vocab + 3} or leave "
                              "it unset")
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
    if m.init_from and m.vocab_size is not None:  # the weights' names and shapes, before any worker starts
        from shardwise.hf.config_map import HFError, hf_path
        from shardwise.hf.load import check_directory

        try:
            check_directory(hf_path(m.init_from), m)
        except HFError as e:
            raise ConfigError(f"model.init_from={m.init_from!r}: {e}") from None
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


def _apply_init_from(m: ModelConfig) -> None:
    """Fill the model's shape from the config.json of ``model.init_from = "hf:PATH"`` (shardwise.hf); a field
    given explicitly must agree with it."""
    from shardwise.hf.config_map import HFError, hf_path, model_fields, read_hf_config

    try:
        path = hf_path(m.init_from)
        fields = model_fields(read_hf_config(path), f"{path}/config.json")
    except HFError as e:
        raise ConfigError(f"model.init_from={m.init_from!r}: {e}") from None
    if m.preset not in ("cpu-demo", "custom"):
        raise ConfigError(f"model.preset={m.preset!r} with model.init_from={m.init_from!r}: the directory's "
                          "config.json gives the model's shape; remove model.preset")
    m.preset = "custom"
    for key, value in fields.items():
        given, default = getattr(m, key), getattr(DEFAULT_MODEL, key)
        if given is not None and given != default and given != value:
            raise ConfigError(f"model.{key}={given!r} but model.init_from={m.init_from!r} has {value!r}; "
                              f"remove model.{key}")
        setattr(m, key, value)


DEFAULT_MODEL = ModelConfig()


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
    _choice("parallel.cp_algorithm", p.cp_algorithm)
    _choice("parallel.cp_balance", p.cp_balance)
    if p.zero not in CHOICES["parallel.zero"]:
        raise ConfigError(f"parallel.zero={p.zero}: use 0 (off), 1, 2 or 3")
    if p.offload not in CHOICES["parallel.offload"]:
        raise ConfigError(f"parallel.offload={p.offload!r}: use 'none', 'cpu' or 'disk'")
    if p.offload != "none" and p.zero == 0:
        raise ConfigError(f"parallel.offload={p.offload!r} needs ZeRO; set parallel.zero to 1, 2 or 3")
    _positive("parallel.zero_unit", p.zero_unit)
    _choice("parallel.zero_param_dtype", p.zero_param_dtype)
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
    _positive("parallel.rdzv_timeout_s", p.rdzv_timeout_s)


def _ps_world(cfg: Config, world_size: int | None) -> int | None:
    """The ranks data parallelism is resolved over: with ``ps.servers`` S, the world minus its last S ranks
    (the servers, :mod:`shardwise.ps`); the data is sharded over the workers."""
    s, p = cfg.ps.servers, cfg.parallel
    _positive("ps.servers", s, allow_zero=True)
    if not s:
        return world_size
    if p.nproc is None:
        p.nproc = default_nproc()
    world = world_size if world_size is not None else p.nproc * p.nnodes
    if s >= world:
        raise ConfigError(f"ps.servers={s} leaves no worker among the {world} ranks; use at most {world - 1} "
                          f"or raise parallel.nproc")
    for dotted, value, off in [("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1), ("parallel.zero", p.zero, 0)]:
        if value != off:  # checked first: the other layout checks would count the servers' ranks
            raise ConfigError(f"ps.servers={s} with {dotted}={value}: the parameter server's workers hold "
                              f"whole replicas; use {dotted}={off} or ps.servers=0")
    return world - s


def _resolve_ps(cfg: Config) -> None:
    """The parameter server's own checks, and what it does not compose with (one line each)."""
    ps, p, t = cfg.ps, cfg.parallel, cfg.train
    _choice("ps.consistency", ps.consistency)
    _choice("ps.scheduling", ps.scheduling)
    _positive("ps.staleness", ps.staleness, allow_zero=True)
    _positive("ps.partition_kb", ps.partition_kb)
    _positive("ps.credit_kb", ps.credit_kb)
    if ps.straggler:
        rank, sep, ms = ps.straggler.partition(":")
        workers = p.dp if ps.servers else None
        if not sep or not rank.strip().isdigit() or not _is_number(ms) or float(ms) < 0:
            raise ConfigError(f"ps.straggler={ps.straggler!r} is not valid; use 'RANK:MS', e.g. '1:200'")
        if workers is not None and int(rank) >= workers:
            raise ConfigError(f"ps.straggler={ps.straggler!r} names rank {int(rank)}, which is not a worker; "
                              f"workers are ranks 0..{workers - 1} (the servers are the last {ps.servers})")
    if not ps.servers:
        return
    if p.backend == "nccl":
        raise ConfigError(f"ps.servers={ps.servers} with parallel.backend='nccl': the parameter server runs on "
                          "gloo point-to-point (CPU tensors); use parallel.backend='gloo' or run.device='cpu'")
    if t.precision == "fp16":
        raise ConfigError(f"ps.servers={ps.servers} with train.precision='fp16': the loss scaler's skipped steps "
                          "would need every worker to agree; use train.precision='bf16' or 'fp32'")
    if t.recompute != "none":
        raise ConfigError(f"ps.servers={ps.servers} with train.recompute={t.recompute!r}: the parameter-server "
                          "workers run the plain model; use train.recompute='none'")
    if t.objective != "causal" or cfg.model.init_from:
        raise ConfigError(f"ps.servers={ps.servers} with train.objective={t.objective!r}, model.init_from="
                          f"{cfg.model.init_from!r}: the parameter server trains next-token windows from the seed's "
                          "initialisation for now; use train.objective='causal' and no init_from")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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


def _check_zero_param_dtype(cfg: Config) -> None:
    p = cfg.parallel
    if p.zero_param_dtype != "fp32" and (p.zero == 0 or cfg.train.precision != "bf16"):
        raise ConfigError(f"parallel.zero_param_dtype={p.zero_param_dtype!r} keeps ZeRO's flat parameters in bf16 "
                          f"beside fp32 masters; it needs parallel.zero >= 1 (is {p.zero}) and train.precision='bf16' "
                          f"(is {cfg.train.precision!r})")


def _resolve_context_parallel(cfg: Config) -> None:
    """Context parallelism cuts every sequence into cp pieces (2*cp chunks with head-tail balance);
    Ulysses also splits the heads (of each tensor-parallel rank) over cp."""
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return
    if m.flavor == "bert":
        raise ConfigError(f"parallel.cp={p.cp} with model.flavor='bert': the context-parallel attention cores are "
                          "causal, and an encoder's padding masks do not follow the sequence split; use parallel.cp=1")
    chunks = 2 * p.cp if p.cp_balance == "headtail" else p.cp
    if cfg.data.seq_len % (chunks * (p.tp if p.sequence_parallel else 1)):
        what = f"{chunks} chunks (parallel.cp={p.cp}, parallel.cp_balance={p.cp_balance!r})"
        if p.sequence_parallel:
            what += f" of a multiple of parallel.tp={p.tp} (sequence parallel)"
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} does not divide into {what}")
    if m.dropout > 0:
        raise ConfigError(f"model.dropout={m.dropout} with parallel.cp={p.cp}: context-parallel attention has no "
                          "attention dropout; use model.dropout=0")
    if p.zero_hpz > 1:
        raise ConfigError(f"parallel.zero_hpz={p.zero_hpz} with parallel.cp={p.cp}: hpZ's node groups are cut from "
                          "the dp ranks, but ZeRO shards over dp x cp; use parallel.zero_hpz=1")
    if p.cp_algorithm == "ulysses":
        heads, kv = m.n_heads // p.tp, max(m.n_kv_heads // p.tp, 1)
        if heads % p.cp:
            raise ConfigError(f"parallel.cp_algorithm='ulysses' splits the {heads} heads of each tensor-parallel "
                              f"rank over parallel.cp={p.cp}; use a cp dividing {heads}, or 'ring'")
        if kv % p.cp and p.cp % kv:
            raise ConfigError(f"parallel.cp_algorithm='ulysses': {kv} key/value heads per tensor-parallel rank "
                              f"neither divide by nor divide parallel.cp={p.cp}; use 'ring'")


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
    if p.ep > 1 and p.zero_hpz > 1:
        raise ConfigError(f"parallel.ep={p.ep} with parallel.zero_hpz={p.zero_hpz}: hpZ's secondary partitions "
                          "span the data-parallel group, expert units do not (not composed); use parallel.zero_hpz=1")
    if m.n_experts and p.cp > 1:
        raise ConfigError(f"model.n_experts={m.n_experts} with parallel.cp={p.cp}: the load-balancing loss of a "
                          "sequence shard is not that of the whole sequence (not composed yet); use parallel.cp=1")
    if m.n_experts and m.flavor == "bert":
        raise ConfigError(f"model.n_experts={m.n_experts} with model.flavor='bert': the experts are decoder "
                          "MLPs (GPT-2 or Llama); use model.n_experts=0 or another flavour")
    if m.n_experts and cfg.ps.servers:
        raise ConfigError(f"model.n_experts={m.n_experts} with ps.servers={cfg.ps.servers}: the parameter "
                          "server's workers do not add the router losses (not composed yet); use ps.servers=0")


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


def _resolve_objective(cfg: Config) -> None:
    """The training objective must suit the flavour; the bert flavour runs under data parallelism and ZeRO."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    _choice("train.objective", t.objective)
    if t.objective != "causal" and m.flavor != "bert":
        raise ConfigError(f"train.objective={t.objective!r} is for the bidirectional bert flavour, but model.flavor="
                          f"{m.flavor!r} is causal; set model.flavor='bert' or train.objective='causal'")
    if t.objective == "classify":
        if m.n_classes < 2:
            raise ConfigError(f"model.n_classes={m.n_classes}: train.objective='classify' needs the number of "
                              "classes (at least 2)")
        from shardwise.data.sources import DataError, open_source

        try:
            kind = open_source(cfg.data.source, cfg.data.format).kind
        except DataError:
            kind = None  # the data layer names the problem when it reads the source
        if kind is not None and kind not in ("jsonl", "parquet"):
            raise ConfigError(f"train.objective='classify' reads a label per document from a jsonl or parquet "
                              f"data.source, but data.source={cfg.data.source!r}; give such a file or directory")
    if m.flavor == "bert":
        if t.objective == "causal":
            raise ConfigError("model.flavor='bert' is a bidirectional encoder: train.objective='causal' would "
                              "let every token see its target; set train.objective='mlm' or 'classify'")
        if p.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel=True with model.flavor='bert' is not implemented yet (its "
                              "token-type embeddings would need splitting along the sequence); use false")
        if p.pp > 1 and t.objective == "classify":
            raise ConfigError(f"parallel.pp={p.pp} with train.objective='classify' is not implemented yet (the "
                              "padding mask would have to travel with the activations); use 1")


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
    _resolve_restarts(cfg)


def _resolve_restarts(cfg: Config) -> None:
    """run.max_restarts defaults to 3 when checkpoints are written during the run (a restart resumes from
    one), else 0; run.fault (test-only) must name existing ranks and steps."""
    from shardwise.train.faults import parse_faults

    r = cfg.run
    if r.max_restarts is None:
        r.max_restarts = 3 if cfg.ckpt.every > 0 else 0
    _positive("run.max_restarts", r.max_restarts, allow_zero=True)
    faults = parse_faults(r.fault, cfg.parallel.nproc * cfg.parallel.nnodes, cfg.train.steps)
    if len(faults) > r.max_restarts + 1:
        raise ConfigError(f"run.fault={r.fault!r} injects {len(faults)} failures, one per attempt, but "
                          f"run.max_restarts={r.max_restarts} allows {r.max_restarts + 1} attempts; raise it")


def _refuse_unused(cfg: Config) -> None:
    """Refuse a field set (away from its default) that the resolved layout never reads, naming what would
    read it: a setting that silently does nothing misleads. Rules run in order; the first that fails is
    reported, so a cause (comm.compression under ZeRO) is named before its consequences (comm.topk_ratio)."""
    m, d, t, p, c, ps = cfg.model, cfg.data, cfg.train, cfg.parallel, cfg.comm, cfg.ps
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
        ("model.n_classes", t.objective == "classify", f"sizes the classifier of train.objective='classify', but "
         f"train.objective={t.objective!r}; set train.objective='classify' or remove it"),
        ("data.label_field", t.objective == "classify", f"names the label of train.objective='classify', but "
         f"train.objective={t.objective!r}; set train.objective='classify' or remove it"),
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
        ("parallel.cp_algorithm", p.cp > 1, "picks context-parallel attention, but parallel.cp=1; set "
         "parallel.cp > 1 or remove it"),
        ("parallel.cp_balance", p.cp > 1, "splits sequences over context-parallel ranks, but parallel.cp=1; set "
         "parallel.cp > 1 or remove it"),
        ("parallel.rdzv_endpoint", p.nnodes > 1, "is where the nodes of a multi-node run meet, but "
         "parallel.nnodes=1; set parallel.nnodes or remove it"),
        ("parallel.rdzv_timeout_s", p.nnodes > 1, "bounds the rendezvous of a multi-node run, but "
         "parallel.nnodes=1; set parallel.nnodes or remove it"),
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
    on = "ps.servers=0 (no parameter server); set ps.servers >= 1 or remove it"
    rules += [
        ("ps.consistency", ps.servers, f"chooses the parameter server's consistency, but {on}"),
        ("ps.staleness", ps.consistency == "ssp", f"bounds ps.consistency='ssp', but ps.consistency="
         f"{ps.consistency!r}; set ps.consistency='ssp' or remove it"),
        ("ps.partition_kb", ps.servers, f"sizes the parameter server's partitions, but {on}"),
        ("ps.scheduling", ps.servers, f"orders the parameter server's pushes, but {on}"),
        ("ps.credit_kb", ps.scheduling == "priority", f"is the credit of ps.scheduling='priority', but "
         f"ps.scheduling={ps.scheduling!r}; set ps.scheduling='priority' or remove it"),
        ("ps.straggler", ps.servers, f"delays a parameter-server worker, but {on}"),
        ("parallel.bucket_mb", not ps.servers, f"sizes all-reduce buckets, but ps.servers={ps.servers} pushes "
         "partitions; set ps.partition_kb instead"),
        ("comm.algorithm", not ps.servers, f"is an all-reduce algorithm, but ps.servers={ps.servers} pushes to "
         "servers point to point; use comm.algorithm='native'"),
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
