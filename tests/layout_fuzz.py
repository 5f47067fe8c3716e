"""A seeded fuzzer of parallel layouts: random valid configs, each trained a few steps and compared with one process.

A *draw* (:func:`draw`) is a set of config overrides: a tiny model (gpt2, llama with grouped-query attention or
bert; dense or a mixture of experts with any router; odd sizes -- layers not divisible by the stages, key/value
heads fewer than tensor-parallel ranks, a vocabulary not divisible by tp; tied or untied embeddings; dropout;
clipping on or off; recomputation) under a random layout of at most ``max_ranks`` ranks (dp, tp with or without
sequence parallelism, pp with every schedule, virtual stages, partitions and micro-batch counts, cp with every
algorithm and balance, ep, etp, ZeRO 1-3 with units, offload, int8 weights or gradients and hpZ).

:func:`check` prepares the draw exactly as ``shardwise train`` does (:func:`shardwise.launch.prepare_run`): a
refusal must be one line (a ``ConfigError``) before any worker starts; anything else there is a bug. The draw
then trains on its ranks (the reusable gloo worker pool of tests/harness.py) and is compared with one process
training the same objective -- the same model, seed, global batch and micro-batch size (a router's
load-balancing loss is a mean per micro-batch, so the reference accumulates the micro-batches each replica
runs) -- by tests/test_train.py's :func:`assert_same_training`: losses, pre-clip gradient norms and final
weights within 1e-5 (fp32). int8 ZeRO++ communication is lossy: such draws are held to their own tolerance,
:data:`LOSSY_ATOL` on losses and weights and :data:`LOSSY_NORM_RTOL` on the norms.

A failing draw is shrunk (:func:`shrink`) to the smallest config that still fails, and :func:`replay_command`
prints it as one command. ``scripts/fuzz_layouts.py`` is the command line; tests/test_fuzz_layouts.py draws a few
per suite run, seeded by the source tree.
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.config import Config, ConfigError

BASE = {"model.preset": "custom", "data.source": "stdlib", "data.max_bytes": 100_000, "train.warmup_steps": 1,
        "train.eps": 1e-4, "train.precision": "fp32", "train.eval_every": 0, "train.eval_batches": 1,
        "train.peak_flops": 1e12, "ckpt.every": 0, "run.progress": False, "run.tensorboard": False}
"""Fixed for every draw. Adam's epsilon sits above the reduction-order noise of small gradients: Adam's first
step moves a weight by lr * g / (|g| + eps), so a gradient near eps that two layouts sum in different orders moves
by up to lr * (its relative noise) -- 1e-5 at eps 1e-6 for draws of one 16-token window (the first 200-draw
campaign: 4 tp draws at 1.02-1.16e-5, equal to 1e-6 with eps 1e-4 and with lr 1e-9, their losses and pre-clip norms
equal). A larger eps also makes Adam less scale-invariant, so a gradient scaled by a constant shows in the weights
more, not less. A peak FLOP/s is given so no run measures a matmul."""

ATOL, NORM_RTOL = 1e-5, 1e-5
LOSSY = ("parallel.zero_quant_weights", "parallel.zero_quant_grads")
LOSSY_ATOL, LOSSY_NORM_RTOL = 5e-2, 0.25
"""int8 ZeRO++ (per-256-element absmax blocks) against one fp32 process, over the draws' 2-3 steps: losses and
weights within 0.05 (tests/test_zero.py bounds the loss by 0.02 after 10 steps; a weight moves by about the
learning rate per Adam step) and pre-clip norms within 25 % (int8 weights moved a norm by 8 % in a draw whose
unquantised twin was exact). Loose: a lossy draw proves the layout runs and stays close; exactness is proven by
the exact draws."""

TIMEOUT_S = 300


@dataclass
class Outcome:
    """What one draw did: "equal", "refused" (one line before any worker), or "failed" (anything else)."""

    kind: str
    detail: str = ""
    overrides: dict = field(default_factory=dict)


# ---- drawing ----------------------------------------------------------------------------------------------


def draw(rng: random.Random, max_ranks: int = 8) -> dict:
    """One random config (overrides on :data:`BASE`): a tiny model under a random layout of <= ``max_ranks``."""
    o: dict = {}
    flavor = rng.choice(("gpt2", "llama", "bert"))
    n_heads = rng.choice((2, 4))
    o.update({"model.flavor": flavor, "model.n_layers": rng.choice((2, 3, 4)), "model.d_model": rng.choice((32, 64)),
              "model.n_heads": n_heads, "data.seq_len": rng.choice((16, 32)), "train.steps": rng.choice((2, 3)),
              "train.seed": rng.randrange(1000), "train.grad_clip": rng.choice((1.0, 0.0))})
    o["model.max_seq_len"] = o["data.seq_len"]
    if flavor == "bert":
        o["train.objective"] = "mlm"
    else:
        o["model.tie_embeddings"] = rng.choice((True, False))
    if flavor == "llama":
        o["model.n_kv_heads"] = rng.choice([k for k in (1, 2, 4) if n_heads % k == 0])
    if rng.random() < 0.3:
        o["model.vocab_size"] = 257 + (3 if flavor == "bert" else 0) + rng.choice((1, 3, 5))  # odd: not divisible by tp
    if rng.random() < 0.3:
        o["model.dropout"] = 0.1
    if rng.random() < 0.3:
        o["train.recompute"] = rng.choice(("full", "selective"))
    moe = rng.random() < 0.35
    if moe:
        o.update({"model.n_experts": 4, "model.moe_top_k": rng.choice((1, 2)),
                  "model.moe_router": rng.choice(("softmax", "softmax_renorm", "sigmoid_bias"))})
        if rng.random() < 0.3:
            o["model.moe_every"] = 2
        if rng.random() < 0.3:
            o["model.moe_shared"] = 1
        if rng.random() < 0.3:
            o["model.moe_capacity_factor"] = 1.25
    # the layout: axes whose product fits in max_ranks
    while True:
        tp, pp, cp, dp = (rng.choice(c) for c in ((1, 1, 2, 4), (1, 1, 2), (1, 1, 2), (1, 2, 2, 4)))
        if tp * pp * cp * dp <= max_ranks and tp * pp * cp * dp > 1:
            break
    o["parallel.nproc"] = tp * pp * cp * dp
    if tp > 1:
        o["parallel.tp"] = tp
        if rng.random() < 0.4:
            o["parallel.sequence_parallel"] = True
        if moe and rng.random() < 0.4:
            o["parallel.etp"] = tp
    micro = rng.choice((1, 2))
    accum = 1
    if pp > 1:
        schedule = rng.choice(("naive", "gpipe", "1f1b", "interleaved", "zb-h1"))
        o.update({"parallel.pp": pp, "parallel.pp_schedule": schedule})
        accum = 1 if schedule == "naive" else rng.choice((pp, 2 * pp))
        o["parallel.microbatches"] = accum
        if schedule == "interleaved":
            o["parallel.pp_virtual"] = 2
            o["model.n_layers"] = max(o["model.n_layers"], 2 * pp)
        partition = rng.choice(("even", "params", "flops", "manual"))
        stages = pp * o.get("parallel.pp_virtual", 1)
        if partition == "manual":
            cuts = sorted(rng.sample(range(1, o["model.n_layers"]), stages - 1)) if o["model.n_layers"] > stages \
                else list(range(1, stages))
            o["parallel.pp_partition"] = ",".join(map(str, cuts))
        else:
            o["parallel.pp_partition"] = partition
    elif rng.random() < 0.3:
        accum = 2
        o["train.grad_accum"] = 2
    o["train.global_batch"] = dp * accum * micro
    if cp > 1:
        o.update({"parallel.cp": cp, "parallel.cp_algorithm": rng.choice(("ring", "allgather", "ulysses")),
                  "parallel.cp_balance": rng.choice(("headtail", "none"))})
    if moe and dp * cp > 1 and rng.random() < 0.6:
        o["parallel.ep"] = rng.choice([e for e in (2, 4) if dp % e == 0] or [1])
    zero = rng.choice((0, 0, 1, 2, 3))
    if zero:
        o["parallel.zero"] = zero
        if zero == 3 and rng.random() < 0.4:
            o["parallel.zero_unit"] = 2
        if rng.random() < 0.25:
            o["parallel.offload"] = rng.choice(("cpu", "disk"))
        if zero == 3 and rng.random() < 0.15:
            o["parallel.zero_quant_weights"] = True
        if rng.random() < 0.15:
            o["parallel.zero_quant_grads"] = True
        if zero == 3 and dp * cp >= 2 and rng.random() < 0.3:
            o["parallel.zero_hpz"] = 2
    return o


def draws(n: int, seed: int, max_ranks: int = 8) -> list[dict]:
    rng = random.Random(seed)
    return [draw(rng, max_ranks) for _ in range(n)]


def source_seed() -> int:
    """A seed from the source tree (src/shardwise and tests, every .py file's path and bytes): a new commit draws
    new layouts, the same tree the same ones, with or without git."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted([*(root / "src" / "shardwise").rglob("*.py"), *(root / "tests").glob("*.py")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return int.from_bytes(h.digest()[:4], "big")


# ---- one draw against one process ---------------------------------------------------------------------------


def texts(overrides: dict) -> dict[str, str]:
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()}


def prepare(overrides: dict, run_dir: Path, cache: Path) -> Config:
    """The resolved config of ``overrides`` as ``shardwise train`` prepares it (ConfigError: refused)."""
    from shardwise.launch import prepare_run

    given = {**BASE, **overrides, "data.cache_dir": str(cache), "run.dir": str(run_dir)}
    return prepare_run(Config.load(overrides=texts(given)))[0]


def reference_overrides(overrides: dict, cfg: Config) -> dict:
    """One process, the same objective: the draw's model, data and training fields, and the micro-batch size its
    replicas run (a router's balance loss is a mean per micro-batch)."""
    ref = {k: v for k, v in overrides.items() if not k.startswith(("parallel.", "comm.")) and k != "train.grad_accum"}
    ref.update({"parallel.nproc": 1, "train.micro_batch": cfg.train.micro_batch})
    return ref


def _train(cfg: Config, run_dir: str):
    """Rank body: the trainer, its terminal output (the start-up table, events) kept out of the fuzzer's."""
    import contextlib
    import io

    from tests.test_train import _train_on_rank

    with contextlib.redirect_stdout(io.StringIO()):
        return _train_on_rank(cfg, run_dir)


def _run(cfg: Config, run_dir: Path):
    from tests.harness import run_on_ranks

    return run_on_ranks(cfg.parallel.nproc, _train, cfg, str(run_dir), timeout=TIMEOUT_S)[0]


class Checker:
    """Runs draws against their one-process references (each reference trained once) in a scratch directory."""

    def __init__(self, cache: Path, work: Path | None = None):
        self.cache = cache
        self.work = Path(work or tempfile.mkdtemp(prefix="fuzz-"))
        self.references: dict[tuple, object] = {}
        self.count = 0

    def _dir(self) -> Path:
        self.count += 1
        return self.work / f"run{self.count}"

    def check(self, overrides: dict) -> Outcome:
        run_dir = self._dir()
        try:
            cfg = prepare(overrides, run_dir, self.cache)
        except ConfigError as e:
            text = str(e)
            if "\n" in text.strip():
                return Outcome("failed", f"a refusal of more than one line: {text!r}", overrides)
            return Outcome("refused", text, overrides)
        except Exception as e:  # noqa: BLE001 - anything but a one-line refusal before spawning is a bug
            return Outcome("failed", f"preparing the run raised {type(e).__name__}: {e}", overrides)
        try:
            ref = self.reference(reference_overrides(overrides, cfg))
            got = _run(cfg, run_dir)
        except Exception as e:  # noqa: BLE001 - a worker's exception or a timeout
            return Outcome("failed", f"the run failed: {_last_line(e)}", overrides)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        from tests.test_train import assert_same_training

        lossy = any(overrides.get(k) for k in LOSSY)
        try:
            assert_same_training(got, ref, atol=LOSSY_ATOL if lossy else ATOL,
                                 norm_rtol=LOSSY_NORM_RTOL if lossy else NORM_RTOL)
        except AssertionError as e:
            return Outcome("failed", f"not the one-process training: {_first_lines(e)}", overrides)
        return Outcome("equal", "", overrides)

    def reference(self, ref: dict):
        key = tuple(sorted((k, repr(v)) for k, v in ref.items()))
        if key not in self.references:
            run_dir = self._dir()
            self.references[key] = _run(prepare(ref, run_dir, self.cache), run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
        return self.references[key]


def _last_line(e: BaseException) -> str:
    """The failing rank's exception line (``SomethingError: ...``) from a worker's traceback, else the last line."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", line)]
    return raised[0] if raised else (lines[-1] if lines else type(e).__name__)


def _first_lines(e: BaseException) -> str:
    """What differs: the comparison's first line, the greatest differences and the tensor's name."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    keep = [line for line in lines[1:] if line.startswith(("Greatest", "Mismatched"))]
    return " | ".join([lines[0], *keep, *(lines[-1:] if lines[-1] not in keep else [])]) if lines else ""


# ---- shrinking ---------------------------------------------------------------------------------------------


REQUIRED = ("parallel.nproc", "model.flavor", "model.n_layers", "model.d_model", "model.n_heads", "data.seq_len",
            "model.max_seq_len", "train.global_batch", "train.steps")
"""Fields a draw always sets (a custom model has no default shape); shrinking makes them smaller, never unset."""


def _smaller(o: dict) -> list[dict]:
    """Simpler neighbours of ``o``, the likeliest to still fail first: a technique off (back to its default), an
    axis or the data-parallel size halved, a size reduced, a plainer flavour."""
    out = []
    for k in sorted(o, key=lambda k: (not k.startswith("parallel."), k)):
        if k not in REQUIRED:
            out.append({kk: v for kk, v in o.items() if kk != k})
    axes = {a: int(o.get(f"parallel.{a}", 1)) for a in ("tp", "pp", "cp")}
    dp = int(o["parallel.nproc"]) // (axes["tp"] * axes["pp"] * axes["cp"])
    for a, n in axes.items():
        if n > 1:
            c = {k: v for k, v in o.items() if k != f"parallel.{a}"}
            c["parallel.nproc"] = int(o["parallel.nproc"]) // n
            out.append(c)
    if dp > 1:
        c = dict(o, **{"parallel.nproc": int(o["parallel.nproc"]) // 2})
        c["train.global_batch"] = max(1, int(o["train.global_batch"]) // 2)
        out.append(c)
    for k, smaller in (("model.n_layers", 2), ("model.d_model", 32), ("train.steps", 1), ("data.seq_len", 16)):
        if k in o and o[k] > smaller:
            c = dict(o, **{k: smaller})
            if k == "data.seq_len":
                c["model.max_seq_len"] = smaller
            out.append(c)
    if o.get("model.flavor") in ("llama", "bert"):
        c = {k: v for k, v in o.items() if k not in ("model.n_kv_heads", "train.objective")}
        out.append(dict(c, **{"model.flavor": "gpt2"}))
    return out


def shrink(checker: Checker, failing: Outcome, budget: int = 40, log: Callable[[str], None] = lambda _s: None) \
        -> Outcome:
    """The smallest config found (greedily, at most ``budget`` checks) that still fails, with its failure."""
    best, tried = failing, 0
    improved = True
    while improved and tried < budget:
        improved = False
        for candidate in _smaller(best.overrides):
            if tried >= budget:
                break
            tried += 1
            outcome = checker.check(candidate)
            if outcome.kind == "failed":
                log(f"  still fails with {len(candidate)} fields: {replay_command(candidate)}")
                best, improved = outcome, True
                break
    return best


def replay_command(overrides: dict) -> str:
    """The one command that trains this config against its one-process reference and says how they differ."""
    parts = " ".join(f"{k}={texts({k: v})[k]}" for k, v in sorted(overrides.items()))
    return f"python scripts/fuzz_layouts.py --replay {parts}"


def parse_replay(items: list[str]) -> dict:
    from shardwise.config import parse_value

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--replay: {item!r} is not FIELD=VALUE")
        out[key] = value if key in ("parallel.pp_partition",) else parse_value(value)
    return out


def describe_failure(outcome: Outcome) -> str:
    return f"FAILED: {outcome.detail}\n  replay: {replay_command(outcome.overrides)}"


def run_campaign(n: int, seed: int, max_ranks: int, cache: Path, log: Callable[[str], None] = print,
                 shrink_budget: int = 40, close_pools: bool = False) -> dict:
    """Draw ``n`` configs from ``seed``, check each (grouped by world size, so each pool starts once), shrink
    every failure; returns the counts and the failures."""
    from tests import harness

    checker = Checker(cache)
    drawn = draws(n, seed, max_ranks)
    order = sorted(range(n), key=lambda i: drawn[i]["parallel.nproc"])
    counts = {"drawn": n, "equal": 0, "refused": 0, "failed": 0}
    refusals: dict[str, int] = {}
    failures = []
    size = None
    try:
        for i in order:
            o = drawn[i]
            if close_pools and size not in (None, o["parallel.nproc"]):
                harness.close_pool(size)
            size = o["parallel.nproc"]
            outcome = checker.check(o)
            counts[outcome.kind] += 1
            log(f"draw {i} ({size} ranks): {outcome.kind}" + (f" -- {outcome.detail}" if outcome.detail else ""))
            if outcome.kind == "refused":
                reason = outcome.detail.split("=")[0]
                refusals[reason] = refusals.get(reason, 0) + 1
            if outcome.kind == "failed":
                log(f"  drawn: {replay_command(o)}")
                small = shrink(checker, outcome, shrink_budget, log) if shrink_budget else outcome
                failures.append({"draw": i, "detail": outcome.detail, "shrunk": replay_command(small.overrides),
                                 "shrunk_detail": small.detail})
                log("  " + describe_failure(small).replace("\n", "\n  "))
    except BaseException:
        log(traceback.format_exc())
        raise
    finally:
        shutil.rmtree(checker.work, ignore_errors=True)
    return {"seed": seed, "max_ranks": max_ranks, **counts, "refusals_by_field": refusals, "failures": failures}
