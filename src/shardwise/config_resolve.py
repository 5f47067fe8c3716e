"""Resolution of the config tree: derived fields filled, then every technique's checks in one list.

:func:`resolve` copies the tree and fills what follows from what was given -- the model (preset sizes,
an ``hf:`` directory's shape, the vocabulary), the data window, the device and backend, the parallel axes
(``dp`` from the world size, over the parameter server's workers), the batch arithmetic
(``global = micro * accum * dp``; with a pipeline, its micro-batches are the accumulation) -- then runs
:data:`CHECKS`, each technique's rules kept beside its code, and last refuses any field set away from its
default that the resolved layout would not read (each technique's ``unused`` rules). Each raises
:class:`~shardwise.config.ConfigError` naming the dotted field, its value and what would be valid, so bad
input fails before any worker starts. A new technique adds its ``checks.py`` to the two lists below.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from shardwise.checks import Unused, choice, divisors, positive
from shardwise.config import Config, ConfigError, ModelConfig, ParallelConfig, RunConfig, TrainConfig, shown
from shardwise.data import checks as data_checks
from shardwise.dist import checks as dist_checks
from shardwise.dist.comm import checks as comm_checks
from shardwise.hf.checks import apply_init_from, check_init_from
from shardwise.model import checks as model_checks
from shardwise.model.checks import check_architecture
from shardwise.model.presets import PRESETS
from shardwise.parallel.context import checks as context_checks
from shardwise.parallel.expert import checks as expert_checks
from shardwise.parallel.expert.checks import check_moe_fields
from shardwise.parallel.pipeline import checks as pipeline_checks
from shardwise.parallel.tensor import checks as tensor_checks
from shardwise.parallel.zero import checks as zero_checks
from shardwise.ps import checks as ps_checks
from shardwise.train import checks as train_checks

CHECKS: list[Callable[[Config], None]] = [
    data_checks.check,
    zero_checks.check,
    dist_checks.check,
    pipeline_checks.check,
    tensor_checks.check,
    context_checks.check,
    expert_checks.check,
    train_checks.check,
    zero_checks.check_param_dtype,
    comm_checks.check,
    train_checks.check_run,
    ps_checks.check,
]
"""Every technique's rules, in the order they are reported: a cause before its consequences."""

UNUSED: list[Callable[[Config], list[Unused]]] = [
    lambda cfg: [Unused("model.rope_theta", cfg.model.flavor == "llama", "sets rotary embeddings, which "
                        f"model.flavor={cfg.model.flavor!r} does not use; use model.flavor='llama' or remove it"),
                  Unused("model.qk_norm", cfg.model.flavor == "llama", "normalises llama's query and key heads; "
                         f"model.flavor={cfg.model.flavor!r} has none; use model.flavor='llama' or remove it")],
    model_checks.unused,
    expert_checks.unused,
    data_checks.unused,
    train_checks.unused,
    pipeline_checks.unused,
    zero_checks.unused,
    tensor_checks.unused,
    context_checks.unused,
    dist_checks.unused,
    comm_checks.unused,
    ps_checks.unused,
]
"""Every technique's fields that a layout may not read, in the order they are checked."""


def resolve(cfg: Config, world_size: int | None = None, tokenizer_vocab: int | None = None,
            weights: bool = True) -> Config:
    """A copy of ``cfg`` with every derived field filled in, or ConfigError.

    ``world_size`` defaults to ``parallel.nproc * parallel.nnodes``; ``tokenizer_vocab`` (when known) fills
    ``model.vocab_size`` and is checked against it; ``weights=False`` (planning, simulating) reads an
    ``model.init_from`` directory's config.json alone."""
    cfg = dataclasses.replace(
        cfg, **{f.name: dataclasses.replace(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    )
    resolve_model(cfg.model, tokenizer_vocab, weights)
    data_checks.check_source(cfg)
    _fill_data(cfg)
    _fill_device(cfg.run, cfg.parallel)
    _fill_parallel(cfg, world_size)
    _fill_microbatches(cfg.parallel, cfg.train)
    _fill_batch(cfg.train, cfg.parallel.dp)
    if cfg.parallel.pp > 1:
        cfg.parallel.microbatches = cfg.train.grad_accum
    _fill_train(cfg)
    for check in CHECKS:
        check(cfg)
    _refuse_unused(cfg)
    return cfg


def resolve_model(m: ModelConfig, tokenizer_vocab: int | None, weights: bool = True) -> None:
    """Fill the model section in place (an ``hf:`` directory's shape, the preset's sizes, the flavour's
    defaults, the vocabulary from the tokenizer) and check its shape (and, with ``weights``, an ``hf:``
    directory's tensors: a plan needs only its config.json)."""
    if m.init_from:
        apply_init_from(m)
    shape = (m.n_layers, m.d_model, m.n_heads)
    if m.preset == "cpu-demo" and m.max_seq_len is None and None not in shape and \
            shape != tuple(PRESETS["cpu-demo"][k] for k in ("n_layers", "d_model", "n_heads")):
        # a shape of its own under the default preset: a custom model, whose max_seq_len follows
        # data.seq_len rather than cpu-demo's 128 (a resolved config has max_seq_len: it stays as it is)
        m.preset, m.flavor = "custom", m.flavor or "gpt2"
    choice("model.preset", m.preset)
    for key, value in PRESETS.get(m.preset, {}).items():
        if getattr(m, key) is None:
            setattr(m, key, value)
    choice("model.flavor", m.flavor)
    for key in ("n_layers", "d_model", "n_heads"):
        if getattr(m, key) is None:
            raise ConfigError(f"model.{key} is not set; give it or choose a model.preset")
        positive(f"model.{key}", getattr(m, key))
    if m.n_kv_heads is None:
        m.n_kv_heads = m.n_heads
    positive("model.n_kv_heads", m.n_kv_heads)
    check_architecture(m)
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}; "
            f"use one of {divisors(m.n_heads)}"
        )
    if m.flavor in ("gpt2", "bert") and m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: the {m.flavor} flavor has no grouped-query attention; "
                          f"use {m.n_heads} or model.flavor='llama'")
    if m.d_ff is None:
        m.d_ff = 4 * m.d_model if m.flavor in ("gpt2", "bert") else 64 * math.ceil(8 * m.d_model / 3 / 64)
    positive("model.d_ff", m.d_ff)
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
    positive("model.vocab_size", m.vocab_size)
    positive("model.max_seq_len", m.max_seq_len)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if weights:
        check_init_from(m)  # the weights' names and shapes, before any worker starts
    positive("model.norm_eps", m.norm_eps)
    positive("model.init_std", m.init_std)
    if m.n_experts is None:
        m.n_experts = 0
    check_moe_fields(m)


def _fill_data(cfg: Config) -> None:
    """The window length defaults to the model's longest sequence, and a custom model's to the window."""
    d, m = cfg.data, cfg.model
    if d.seq_len is None:
        d.seq_len = m.max_seq_len
    if d.seq_len is None:
        raise ConfigError("data.seq_len is not set and the model has no max_seq_len; give data.seq_len")
    positive("data.seq_len", d.seq_len)
    if m.max_seq_len is None:
        m.max_seq_len = d.seq_len


def _fill_device(r: RunConfig, p: ParallelConfig) -> None:
    """run.device picks the backend (cpu: gloo, cuda: nccl) and the default number of workers."""
    choice("run.device", r.device)
    choice("parallel.backend", p.backend)
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
    elif p.backend == "nccl" and not _cuda_available():
        raise ConfigError("parallel.backend='nccl' needs GPUs but no GPU is visible; use 'gloo' or 'auto'")


def _fill_parallel(cfg: Config, world_size: int | None) -> None:
    """``parallel.dp`` from the world (less the parameter server's ranks) and the model-parallel axes."""
    p = cfg.parallel
    if p.nproc is None:
        p.nproc = default_nproc()
    positive("parallel.nproc", p.nproc)
    positive("parallel.nnodes", p.nnodes)
    world = ps_checks.worker_world(cfg, world_size if world_size is not None else p.nproc * p.nnodes)
    for axis in ("tp", "pp", "cp", "ep"):
        positive(f"parallel.{axis}", getattr(p, axis))
    model_parallel = p.tp * p.pp * p.cp
    if p.dp is None:
        if world % model_parallel:
            raise ConfigError(
                f"parallel.tp*pp*cp={model_parallel} does not divide the world size {world}; "
                f"use a product among {divisors(world)}"
            )
        p.dp = world // model_parallel
    positive("parallel.dp", p.dp)
    if p.dp * model_parallel != world:
        raise ConfigError(
            f"parallel.dp*tp*pp*cp={p.dp * model_parallel} does not match the world size {world} "
            f"(parallel.nproc={p.nproc} x parallel.nnodes={p.nnodes}); set parallel.dp={world // model_parallel}"
            if world % model_parallel == 0
            else f"parallel.dp*tp*pp*cp={p.dp * model_parallel} does not match the world size {world}"
        )


def _fill_train(cfg: Config) -> None:
    """The cosine decay's floor (lr / 10), and restarts (3 when checkpoints are written during the run: a
    restart resumes from one, else 0)."""
    t, r = cfg.train, cfg.run
    if t.min_lr is None:
        t.min_lr = t.lr / 10
    if r.max_restarts is None:
        r.max_restarts = 3 if cfg.ckpt.every > 0 else 0


def _refuse_unused(cfg: Config) -> None:
    """Refuse a field set (away from its default) that the resolved layout never reads, naming what would
    read it. Rules run in order; the first that fails is reported."""
    for rules in UNUSED:
        for dotted, read, why in rules(cfg):
            value = _field(cfg, dotted)
            if not read and value != _field(DEFAULTS, dotted):
                raise ConfigError(f"{dotted}={shown(value)} {why}")


DEFAULTS = Config()
"""The tree as constructed: a field equal to its default here counts as not set."""


def _field(cfg: Config, dotted: str):
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def _fill_batch(t: TrainConfig, dp: int) -> None:
    """Solve global_batch = micro_batch * grad_accum * dp: any two of the three set the third."""
    for key in ("global_batch", "micro_batch", "grad_accum"):
        positive(f"train.{key}", getattr(t, key))
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


def _fill_microbatches(p: ParallelConfig, t: TrainConfig) -> None:
    """With pp > 1 a step's micro-batches are the pipeline's: ``parallel.microbatches`` is ``train.grad_accum``.

    Unset, it is the largest of 4p, 2p, p (1 for "naive") that divides the replica's batch: the bubble
    (p - 1) / (m + p - 1) shrinks with m (Narayanan et al. 2021 §2.2.1)."""
    if p.pp == 1:
        return
    m = p.microbatches
    if m is not None:
        positive("parallel.microbatches", m)
        if t.grad_accum is not None and t.grad_accum != m:
            raise ConfigError(f"train.grad_accum={t.grad_accum} != parallel.microbatches={m}: with parallel.pp > 1 "
                              "the micro-batches of a step are the pipeline's; set only one of them")
        t.grad_accum = m
    elif t.grad_accum is None and t.micro_batch is None and t.global_batch is not None \
            and t.global_batch % p.dp == 0:
        replica = t.global_batch // p.dp
        options = [1] if p.pp_schedule == "naive" else [4 * p.pp, 2 * p.pp, p.pp, 1]
        t.grad_accum = next(c for c in options if replica % c == 0)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_nproc() -> int:
    """The number of GPUs, or 2 CPU workers when there is none."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2
