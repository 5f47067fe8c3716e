"""One tree of dataclasses holding every setting of a run.

Every field can be set from a TOML file (``[train] lr = 3e-4``) and overridden on the
command line by its dotted name (``--train.lr 3e-4``). ``Config.resolve()`` fills the
derived fields (preset sizes, batch arithmetic, data-parallel size) and validates the
whole tree before any worker process starts; an invalid value raises ``ConfigError``
naming the field, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from shardwise.model.presets import PRESET_NAMES, PRESETS


class ConfigError(ValueError):
    """A config value is invalid. The message is one line, fit to show a user."""


@dataclass
class ModelConfig:
    preset: str = "cpu-demo"
    """Named size (see shardwise.model.presets) or "custom"; explicit fields override it."""
    flavor: str | None = None
    """"gpt2" (LayerNorm, GELU, learned positions, tied embeddings) or "llama" (RMSNorm, SwiGLU, RoPE, GQA)."""
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
    """Base of the rotary position frequencies (llama)."""
    dropout: float = 0.0
    """Dropout probability on attention and residual branches."""
    tie_embeddings: bool | None = None
    """Share token embedding and output head; default True for gpt2, False for llama."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation (GPT-2 scheme)."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """"stdlib" (the running Python's standard library .py files), or a path: a directory of text
    files, a .txt, .jsonl or .parquet file, or a Hugging Face dataset saved with save_to_disk."""
    format: str = "auto"
    """"auto" (by extension), "text", "jsonl", "parquet" or "hf"."""
    text_field: str = "text"
    """Field (jsonl) or column (parquet, hf) that holds the text."""
    tokenizer: str = "byte"
    """"byte" (UTF-8 bytes + end-of-text, no training), "bpe" (trained on the corpus with the
    tokenizers library and saved with the run), or a path to a tokenizer.json."""
    bpe_vocab_size: int = 4096
    """Vocabulary size when tokenizer = "bpe"."""
    seq_len: int | None = None
    """Tokens per training window; default model.max_seq_len."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation (chosen by a hash of the document name)."""
    max_bytes: int = 0
    """Read at most this many bytes of corpus text (0 = all)."""
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
    seed: int = 1337
    """Seeds weight initialisation, data order and dropout; the same for every layout."""
    precision: str = "bf16"
    """"fp32", "bf16" (autocast) or "fp16" (autocast with a dynamic loss scaler). Master weights are fp32."""
    fp16_init_scale: float = 2.0**16
    """Initial loss scale for fp16."""
    fp16_growth_interval: int = 2000
    """Steps without overflow after which the fp16 loss scale doubles."""
    recompute: str = "none"
    """Activation checkpointing: "none" or "full" (recompute blocks in backward)."""
    recompute_every: int = 1
    """With recompute = "full": checkpoint every k-th block (1 = every block)."""
    eval_every: int = 50
    """Validation loss every N steps (and at the end; 0 = only at the end)."""
    eval_batches: int = 8
    """Micro-batches per validation."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU; 0 = look up the GPU, or measure a matmul on CPU."""


@dataclass
class ParallelConfig:
    nproc: int | None = None
    """Worker processes on this machine; default the number of GPUs, or 2 without a GPU."""
    nnodes: int = 1
    """Machines (set by torchrun on multi-node runs)."""
    dp: int | None = None
    """Data-parallel size; default world size / (tp * pp * cp)."""
    tp: int = 1
    """Tensor-parallel size (not implemented yet: must be 1)."""
    pp: int = 1
    """Pipeline-parallel stages (shardwise.parallel.pipeline); the model's blocks are split among them."""
    cp: int = 1
    """Context-parallel size (not implemented yet: must be 1)."""
    ep: int = 1
    """Expert-parallel size (not implemented yet: must be 1)."""
    zero: int = 0
    """ZeRO stage (Rajbhandari et al. 2020): 0 = plain data parallel, 1 = shard optimizer states,
    2 = also gradients, 3 = also parameters (shardwise.parallel.zero)."""
    zero_unit: int = 1
    """With zero = 3: transformer blocks per sharding unit (gathered and freed together)."""
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
    pp_schedule: str = "1f1b"
    """With pp > 1: "naive", "gpipe", "1f1b" or "interleaved" (with pp_virtual >= 2 chunks per rank)."""
    microbatches: int | None = None
    """With pp > 1: pipeline micro-batches per step and replica (= train.grad_accum; the micro-batches
    of a step flow through the pipeline); default the largest of 4*pp, 2*pp, pp that divides the batch."""
    pp_virtual: int = 1
    """With pp_schedule = "interleaved": model chunks per pipeline rank (v)."""
    pp_partition: str = "params"
    """With pp > 1: how blocks are split into stages: "even", "params" or "flops" (balanced by that
    cost, embedding and head included), or the first block of every stage after the first ("2,5")."""
    sequence_parallel: bool = False
    """Sequence parallelism with tensor parallelism (not implemented yet: must be false)."""
    bucket_mb: float = 25.0
    """Gradient all-reduce bucket size in MiB."""
    backend: str = "auto"
    """"auto" (nccl with GPUs, gloo otherwise), "nccl" or "gloo"."""
    timeout_s: float = 600.0
    """A collective that waits longer than this fails instead of hanging."""


COMM_ALGORITHMS = ("auto", "native", "naive", "star", "ring", "rabenseifner", "recursive_doubling", "tree",
                   "hierarchical", "torus")
"""Gradient all-reduce algorithms (shardwise.dist.comm.allreduce; "auto" asks the cost model)."""

COMM_COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk")
"""Gradient compression methods (shardwise.dist.comm.compress)."""


@dataclass
class CommConfig:
    algorithm: str = "native"
    """Gradient all-reduce algorithm: "native" (the backend's own), "auto" (the calibrated cost
    model picks per bucket size), or one of ours: "naive", "star", "ring", "rabenseifner",
    "recursive_doubling", "tree", "hierarchical", "torus"."""
    compression: str = "none"
    """Gradient compression: "none", "fp16", "bf16" (cast), "int8" (per-chunk absmax, error
    feedback) or "topk" (sparsification, error feedback)."""
    topk_ratio: float = 0.01
    """Fraction of gradient entries "topk" sends each step, in (0, 1]."""
    node_size: int = 0
    """Ranks per node for "hierarchical" (0: 2) and row length for "torus" (0: most square grid)."""
    timeout_s: float = 0.0
    """Seconds a gradient all-reduce waits for a peer before failing with an error naming the
    collective (0: the process group's parallel.timeout_s, which also bounds the backend's own
    uncompressed "native" all-reduce)."""


@dataclass
class CkptConfig:
    every: int = 100
    """Save a checkpoint every N steps (0 = only at the end)."""
    keep: int = 2
    """Keep the newest K checkpoints."""
    resume: bool = False
    """Continue from the newest valid checkpoint in run.dir/checkpoints."""


@dataclass
class RunConfig:
    dir: str = ""
    """Run directory; default runs/<preset>-<date>-<time> (with runs/latest pointing at it)."""
    device: str = "auto"
    """"auto" (cuda if available), "cpu" (gloo workers, 2 by default) or "cuda" (nccl, one worker per GPU)."""
    progress: bool = True
    """Show a progress bar on the terminal."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
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
    def load(cls, path: str | os.PathLike | None = None, overrides: dict[str, str] | None = None) -> Config:
        """Read a TOML file (if given), then apply ``{"section.key": "text value"}`` overrides."""
        tree: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {str(p)!r} does not exist")
            try:
                tree = tomllib.loads(p.read_text())
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        cfg = cls.from_dict(tree)
        for dotted, text in (overrides or {}).items():
            cfg.set(dotted, parse_value(text))
        return cfg

    def set(self, dotted: str, value: Any) -> None:
        """Set one field by dotted name, converting and checking the type."""
        section_name, _, key = dotted.partition(".")
        sections = {f.name for f in dataclasses.fields(self)}
        if section_name not in sections or not key:
            raise ConfigError(f"unknown config key {dotted!r}{_suggest(section_name, sections)}")
        section = getattr(self, section_name)
        hints = typing.get_type_hints(type(section))
        if key not in hints:
            names = [f"{section_name}.{n}" for n in hints]
            raise ConfigError(f"unknown config key {dotted!r}{_suggest(dotted, names)}")
        setattr(section, key, _coerce(dotted, value, hints[key]))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The tree as TOML; unset (None) fields are left out, as TOML has no null."""
        import tomli_w

        tree = {s: {k: v for k, v in vals.items() if v is not None} for s, vals in self.to_dict().items()}
        return tomli_w.dumps(tree)

    # ---- resolution and validation ------------------------------------------------------

    def resolve(self, world_size: int | None = None, tokenizer_vocab: int | None = None) -> Config:
        """Return a copy with every derived field filled in, or raise ConfigError.

        ``world_size`` defaults to ``parallel.nproc * parallel.nnodes``; ``tokenizer_vocab``
        (when known) fills ``model.vocab_size`` and is checked against it.
        """
        cfg = dataclasses.replace(
            self, **{f.name: dataclasses.replace(getattr(self, f.name)) for f in dataclasses.fields(self)}
        )
        _resolve_model(cfg.model, tokenizer_vocab)
        _resolve_data(cfg)
        _resolve_device(cfg.run, cfg.parallel)
        _resolve_parallel(cfg.parallel, world_size)
        _default_microbatches(cfg.parallel, cfg.train)
        _resolve_batch(cfg.train, cfg.parallel.dp)
        _resolve_pipeline(cfg)
        _validate_train(cfg.train)
        _validate_misc(cfg)
        return cfg


# ---- value parsing -------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """Turn a command-line string into a TOML-like value: 3 -> int, 1e-3 -> float, true -> bool,
    none -> None; anything else stays a string."""
    if not isinstance(text, str):
        return text
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(dotted: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    allowed = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{dotted}=None is not allowed; give a {_type_name(allowed)}")
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
    raise ConfigError(f"{dotted}={value!r} is not a {_type_name(allowed)}")


def _type_name(types_: tuple) -> str:
    return " or ".join(getattr(t, "__name__", str(t)) for t in types_ if t is not type(None))


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"


def _choice(dotted: str, value: Any, options: tuple) -> None:
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


# ---- section resolvers ---------------------------------------------------------------------


def _resolve_model(m: ModelConfig, tokenizer_vocab: int | None) -> None:
    _choice("model.preset", m.preset, PRESET_NAMES)
    for key, value in PRESETS.get(m.preset, {}).items():
        if getattr(m, key) is None:
            setattr(m, key, value)
    _choice("model.flavor", m.flavor, ("gpt2", "llama"))
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


def _resolve_data(cfg: Config) -> None:
    d, m = cfg.data, cfg.model
    _choice("data.format", d.format, ("auto", "text", "jsonl", "parquet", "hf"))
    if d.source != "stdlib" and not Path(d.source).exists():
        raise ConfigError(f"data.source={d.source!r} does not exist; give a file or directory, or 'stdlib'")
    if d.tokenizer not in ("byte", "bpe") and not Path(d.tokenizer).is_file():
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
    _choice("run.device", r.device, ("auto", "cpu", "cuda"))
    _choice("parallel.backend", p.backend, ("auto", "nccl", "gloo"))
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
    for axis, name in (("tp", "tensor"), ("cp", "context"), ("ep", "expert")):
        if getattr(p, axis) != 1:
            raise ConfigError(f"parallel.{axis}={getattr(p, axis)}: {name} parallelism is not implemented yet; use 1")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={p.zero}: use 0 (off), 1, 2 or 3")
    if p.offload not in ("none", "cpu", "disk"):
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
    if p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel=true: sequence parallelism is not implemented yet; use false")
    _positive("parallel.bucket_mb", p.bucket_mb)
    _positive("parallel.timeout_s", p.timeout_s)


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
    if p.pp == 1:
        if p.pp_virtual != 1:
            raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp > 1; use 1")
        return
    p.microbatches = cfg.train.grad_accum
    if p.zero:
        raise ConfigError(f"parallel.zero={p.zero} with parallel.pp={p.pp}: ZeRO inside a pipeline is not "
                          "implemented; use parallel.zero=0 with pipeline parallelism")
    from shardwise.parallel.pipeline import check_pipeline, partition

    try:
        check_pipeline(cfg.model.n_layers, p.pp, p.pp_schedule, p.microbatches,
                       cfg.train.micro_batch * p.microbatches, p.pp_virtual)
        method, boundaries = pipeline_partition(p.pp_partition)
        if method == "manual":  # a cost-balanced split always exists once there are enough layers
            partition(cfg.model, p.pp * p.pp_virtual, method, boundaries)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def pipeline_partition(text: str) -> tuple[str, list[int] | None]:
    """``parallel.pp_partition`` as ``(method, boundaries)``: a method name, or "2,5" -> ("manual", [2, 5])."""
    text = str(text).strip()
    if text and all(part.strip().isdigit() for part in text.split(",")):
        return "manual", [int(part) for part in text.split(",")]
    if text not in ("even", "params", "flops"):
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
    _choice("train.precision", t.precision, ("fp32", "bf16", "fp16"))
    _positive("train.fp16_init_scale", t.fp16_init_scale)
    _positive("train.fp16_growth_interval", t.fp16_growth_interval)
    _choice("train.recompute", t.recompute, ("none", "full"))
    _positive("train.recompute_every", t.recompute_every)
    _positive("train.eval_every", t.eval_every, allow_zero=True)
    _positive("train.eval_batches", t.eval_batches)
    _positive("train.peak_flops", t.peak_flops, allow_zero=True)


def _validate_misc(cfg: Config) -> None:
    _choice("comm.algorithm", cfg.comm.algorithm, COMM_ALGORITHMS)
    _choice("comm.compression", cfg.comm.compression, COMM_COMPRESSIONS)
    if not 0 < cfg.comm.topk_ratio <= 1:
        raise ConfigError(f"comm.topk_ratio={cfg.comm.topk_ratio} is not valid; use a fraction in (0, 1]")
    _positive("comm.node_size", cfg.comm.node_size, allow_zero=True)
    _positive("comm.timeout_s", cfg.comm.timeout_s, allow_zero=True)
    _positive("ckpt.every", cfg.ckpt.every, allow_zero=True)
    _positive("ckpt.keep", cfg.ckpt.keep)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_nproc() -> int:
    """The number of GPUs, or 2 CPU workers when there is none."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2
