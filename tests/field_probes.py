"""What a run does, seen from outside, under a set of config overrides: the observers of
tests/test_config_fields.py, which proves every config field by a difference one of them sees.

Each observer takes the overrides (dotted field -> value, on top of its own small base config) and returns
a dict of *aspects* -- the places a field can act:

* ``model`` (this process, milliseconds): the model one process builds -- ``shape`` (parameter names and
  shapes), ``init`` (initial values), ``output`` (training-mode loss and logits on fixed tokens),
  ``grads``;
* ``data`` (this process): ``tokens`` (the first training and validation windows the objective reads,
  and how many there are), ``vocab``, ``labels``, ``files`` (everything under the probe's own directory);
* ``train`` (the trainer itself, ``shardwise.worker.train``, on 1-3 gloo ranks of the reusable worker pool,
  a tiny model for 2 steps): ``losses``, ``grad_norms``, ``weights`` (final, with buffers), ``metric:KEY``
  (that column of ``metrics.jsonl``; never a clock's reading, which differs between any two runs),
  ``ratio:A/B`` (two columns' ratio per row, where a clock cancels), ``files`` (what the run directory holds),
  ``stdout_has:TEXT``, ``calls:NAME`` (how often rank 0 ran ``Block.forward``, ``Attention.core``, ZeRO-1/2's
  pre-forward wait for its gathered buckets (``zero_gather_hook``), ``torch.compile`` or a ``torch.distributed``
  function), ``export:KEY`` (a key of the ``config.json`` ``shardwise export --format hf`` writes),
  ``error`` (the exception's last line) and ``refused`` (the one-line refusal, before any worker);
* ``launch`` (this process, :func:`shardwise.launch.launch` with the elastic launcher and the process group
  replaced by recorders, so nothing is spawned): ``spawned``, ``nproc_per_node``, ``nodes``,
  ``max_restarts``, ``rdzv``, ``pg_timeout`` (the one-process group the in-process worker asks for), ``files``;
* ``collective`` (2 ranks): the data-parallel gradient all-reduce the engine builds from the ``comm``
  section, with the second rank 1 s late -- ``outcome`` ("ok" or its error line).

A value or context of ``"{tmp}"`` is the probe's own fresh directory. A key ``probe.tty`` runs the trainer with
a terminal as stdout, ``probe.export`` exports the run afterwards, ``probe.prior`` trains the same run
directory for that many steps first (checkpoints to resume), ``probe.gpus`` makes ``launch`` see that many
GPUs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()
"""In a context: leave this field of the observer's base config at its default."""

MODEL = {"model.preset": "custom", "model.flavor": "gpt2", "model.n_layers": 2, "model.d_model": 32,
         "model.n_heads": 4, "model.max_seq_len": 16, "data.seq_len": 16, "parallel.nproc": 1,
         "train.precision": "fp32"}
"""A tiny model: every model field acts on it within milliseconds."""

TRAIN = {**MODEL, "data.source": "stdlib", "data.max_bytes": 100_000, "data.cache_dir": "{cache}",
         "train.steps": 2, "train.global_batch": 4, "train.warmup_steps": 1, "train.eval_every": 0,
         "train.eval_batches": 1, "train.peak_flops": 1e12, "ckpt.every": 0, "run.progress": False,
         "run.tensorboard": False}
"""Two steps of the tiny model on 4 windows of 16 tokens per step (and a checkpoint at the end); a peak FLOP/s
given, so no run measures a matmul for its MFU."""

DATA = {**TRAIN, "data.max_bytes": 20_000}


def texts(overrides: dict) -> dict[str, str]:
    """Overrides as the command line gives them."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()}


def merged(base: dict, overrides: dict, paths: dict[str, Path]) -> tuple[dict, dict]:
    """(config overrides, probe options): ``base`` under ``overrides``, UNSET keys dropped, ``probe.*`` apart,
    each placeholder of ``paths`` ("{tmp}", "{cache}", ...) in a text value replaced by its path."""
    out = {}
    for k, v in {**base, **overrides}.items():
        if v is UNSET:
            continue
        if isinstance(v, str):
            for name, path in paths.items():
                v = v.replace(name, str(path))
        out[k] = v
    return {k: v for k, v in out.items() if not k.startswith("probe.")}, \
        {k[6:]: v for k, v in out.items() if k.startswith("probe.")}


def tree_files(root: Path) -> list[str]:
    """Every file under ``root``, relative, sorted; file names that hold a date or a random part generalised."""
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ---- model ----------------------------------------------------------------------------------------------


def observe_model(overrides: dict, paths: dict[str, Path]) -> dict:
    from shardwise.model import Transformer

    cfg_overrides, _ = merged(MODEL, overrides, paths)
    cfg = resolve(Config.load(overrides=texts(cfg_overrides)), tokenizer_vocab=257)
    m = cfg.model
    model = Transformer(m)
    model.reset_parameters(cfg.train.seed)
    model.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (2, cfg.data.seq_len), generator=g)
    classify = cfg.train.objective == "classify"
    targets = torch.randint(0, m.n_classes, (2,), generator=g) if classify else \
        torch.randint(0, 257, (2, cfg.data.seq_len), generator=g)
    torch.manual_seed(0)  # dropout without a key draws from torch's generator
    loss = model(tokens, targets)
    loss.backward()
    with torch.no_grad():
        torch.manual_seed(0)
        logits = model(tokens)
    return {"shape": {n: tuple(p.shape) for n, p in model.named_parameters()},
            "init": {n: p.detach().clone() for n, p in model.state_dict().items()},
            "output": {"loss": loss.detach(), "logits": logits},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


# ---- data -------------------------------------------------------------------------------------------------


def observe_data(overrides: dict, paths: dict[str, Path]) -> dict:
    from shardwise.data import prepare_corpus
    from shardwise.data.objectives import objective_windows

    cfg_overrides, _ = merged(DATA, overrides, paths)
    cfg = resolve(Config.load(overrides=texts(cfg_overrides)))
    corpus = prepare_corpus(cfg.data, None)
    cfg = resolve(cfg, tokenizer_vocab=corpus.vocab_size)
    seen = {}
    for split in ("train", "val"):
        windows = objective_windows(cfg, corpus, split)
        n = min(len(windows), 4)
        seen[split] = (len(windows), [t.clone() for t in windows.batch(list(range(n)))])
    return {"tokens": seen, "vocab": corpus.vocab_size, "labels": seen["train"][1][1:],
            "files": tree_files(paths["{tmp}"])}


# ---- the trainer, in the worker pool ---------------------------------------------------------------------


class _Counting:
    """Count calls of a few functions (class attributes replaced for the duration, then put back)."""

    DIST = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
            "broadcast", "isend", "irecv", "batch_isend_irecv", "barrier")

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        from shardwise.model.layers import Attention
        from shardwise.model.transformer import Block
        from shardwise.parallel.zero.gather import _WaitForUnits

        self.calls: dict[str, int] = {}
        self.targets = [(Block, "forward", "Block.forward"), (Attention, "core", "Attention.core"),
                        (_WaitForUnits, "__call__", "zero_gather_hook")]
        # both names of a collective (P2POp accepts only the function c10d's isend / irecv names)
        self.targets += [(owner, name, name) for name in self.DIST for owner in (dist, c10d)]
        self.saved = []

        def compile_recorded(fn=None, *args, **kwargs):  # records the request, compiles nothing (fast)
            self.calls["torch.compile"] = self.calls.get("torch.compile", 0) + 1
            return fn if fn is not None else (lambda f: f)
        self.compile = compile_recorded

    def __enter__(self):
        wrapped = {}
        for owner, attr, name in self.targets:
            original = getattr(owner, attr)
            self.saved.append((owner, attr, original))
            if id(original) not in wrapped:
                wrapped[id(original)] = self._counted(original, name)
            setattr(owner, attr, wrapped[id(original)])
        self.saved.append((torch, "compile", torch.compile))
        torch.compile = self.compile
        return self

    def _counted(self, fn, name):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self.saved):
            setattr(owner, attr, original)


def _stdout(tty: bool):
    """A terminal (a pseudo-terminal) or a plain buffer as sys.stdout; returns (context, read)."""
    if not tty:
        buf = io.StringIO()
        return contextlib.redirect_stdout(buf), buf.getvalue
    master, slave = os.openpty()
    stream = open(slave, "w", buffering=1, closefd=True)  # noqa: SIM115 - closed by read()
    os.set_blocking(master, False)

    def read() -> str:
        stream.close()
        chunks = []
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(master, 65536):
                chunks.append(chunk)
        os.close(master)
        return b"".join(chunks).decode(errors="replace")
    return contextlib.redirect_stdout(stream), read


def _train_job(cfg: Config, run_dir: str, options: dict) -> dict | None:
    """One trainer run on every rank of the pool; rank 0 reports what it saw."""
    import torch.distributed as dist

    from shardwise.train.metrics import read_metrics
    from shardwise.worker import train

    rank = dist.get_rank()
    stop_after = options.get("stop_after")
    redirect, read = _stdout(bool(options.get("tty")) and rank == 0)
    seen: dict[str, Any] = {}
    with _Counting() as counting, redirect:
        try:
            result = train(cfg, Path(run_dir), collect_state=True, stop_after=stop_after)
            seen.update(losses=result.losses, grad_norms=result.grad_norms, weights=result.state_dict)
        except Exception as e:  # noqa: BLE001 - what the run did is the observation
            seen["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"
    seen["stdout"] = read()
    if rank != 0:
        return None
    seen["calls"] = counting.calls
    seen["metrics"] = read_metrics(Path(run_dir)) if (Path(run_dir) / "metrics.jsonl").exists() else []
    if options.get("export") and "error" not in seen:
        from shardwise.hf.export import export_run

        out = Path(run_dir).parent / (Path(run_dir).name + "-hf")
        export_run(Path(run_dir), out)
        seen["export"] = json.loads((out / "config.json").read_text())
    return seen


def _train_jobs(jobs: list) -> list | None:
    """Rank body: several trainer runs in one pool call."""
    out = [_train_job(*job) for job in jobs]
    return out if out and out[0] is not None else None


def prepare_train(overrides: dict, paths: dict[str, Path]) -> tuple[Config | None, dict, dict]:
    """(resolved config or None, probe options, observation so far) for one trainer job, prepared in this
    process as ``shardwise train`` prepares it (the run directory: ``{tmp}/run``): a refusal is the observation."""
    from shardwise.launch import prepare_run

    cfg_overrides, options = merged({**TRAIN, "run.dir": "{tmp}/run"}, overrides, paths)
    try:
        cfg, _ = prepare_run(Config.load(overrides=texts(cfg_overrides)))
    except ConfigError as e:
        return None, options, {"refused": str(e)}
    return cfg, options, {}


def run_train_jobs(jobs: dict[Any, tuple[dict, dict[str, Path]]]) -> dict[Any, dict]:
    """Observe every trainer job ``key -> (overrides, paths)``: grouped by world size, one pool call per
    group (and one before them for the runs whose directory must first hold a checkpoint)."""
    from tests.harness import run_on_ranks

    out: dict[Any, dict] = {}
    groups: dict[int, list] = {}
    priors: dict[int, list] = {}
    for key, (overrides, paths) in jobs.items():
        cfg_overrides, options = merged(TRAIN, overrides, paths)
        nproc = int(cfg_overrides["parallel.nproc"])
        if options.get("prior"):  # the same run directory trained (and checkpointed) first
            prior = {k: v for k, v in overrides.items() if k not in ("probe.prior", "ckpt.resume")}
            cfg, _, seen = prepare_train(prior, paths)
            assert cfg is not None, seen
            priors.setdefault(nproc, []).append((cfg, cfg.run.dir, {"stop_after": options["prior"]}))
        groups.setdefault(nproc, []).append(key)
    for nproc, batch in priors.items():
        run_on_ranks(nproc, _train_jobs, batch, timeout=600)
    for nproc, keys in sorted(groups.items()):
        runnable = []
        for key in keys:
            cfg, options, out[key] = prepare_train(*jobs[key])
            if cfg is not None:
                runnable.append((key, (cfg, cfg.run.dir, options)))
        results = run_on_ranks(nproc, _train_jobs, [job for _, job in runnable], timeout=600)[0] if runnable else []
        for (key, _), seen in zip(runnable, results, strict=True):
            out[key].update(seen, files=tree_files(jobs[key][1]["{tmp}"]))
    return out


def train_aspect(seen: dict, aspect: str):
    """One aspect of a trainer observation (None where the run did not get that far)."""
    if aspect in ("refused", "error"):
        return seen.get(aspect)
    if "refused" in seen:
        return ("refused", seen["refused"])
    kind, _, key = aspect.partition(":")
    if kind == "metric":
        return [(r["step"], r[key]) for r in seen.get("metrics", []) if key in r]
    if kind == "ratio":  # two columns of one row, e.g. mfu / tokens_per_s: what is left when the clock cancels
        a, b = key.split("/")
        return [(r["step"], float(f"{r[a] / r[b]:.6g}")) for r in seen.get("metrics", []) if a in r and b in r]
    if kind == "stdout_has":
        return key in seen.get("stdout", "")
    if kind == "calls":
        return seen.get("calls", {}).get(key, 0)
    if kind == "export":
        return seen.get("export", {}).get(key)
    return seen.get(kind)


# ---- the launcher, with nothing spawned -------------------------------------------------------------------


class _Stop(Exception):
    """Raised by the recorders once the launcher has said what it would start."""


def observe_launch(overrides: dict, paths: dict[str, Path]) -> dict:
    """What ``shardwise train`` would start: the elastic launcher's settings, or the in-process worker's
    process group; nothing is spawned and no step runs."""
    import torch.distributed as dist
    import torch.distributed.launcher.api as launcher_api

    from shardwise.launch import launch

    cfg_overrides, options = merged({**TRAIN, "run.dir": "{tmp}/run"}, overrides, paths)
    seen: dict[str, Any] = {"spawned": False}

    def elastic_launch(config, entrypoint):
        def start(*args):
            seen.update(spawned=True, nproc_per_node=config.nproc_per_node, nodes=(config.min_nodes, config.max_nodes),
                        max_restarts=config.max_restarts, rdzv=(config.rdzv_endpoint, config.rdzv_configs))
            raise _Stop
        return start

    def init_process_group(backend=None, *args, timeout=None, **kwargs):
        seen.update(pg_backend=backend, pg_timeout=timeout.total_seconds() if timeout else None)
        raise _Stop

    gpus = int(options.get("gpus", 0))
    env = dict(os.environ)
    patches = [(launcher_api, "elastic_launch", elastic_launch), (dist, "init_process_group", init_process_group)]
    if gpus:
        patches += [(torch.cuda, "is_available", lambda: True), (torch.cuda, "device_count", lambda: gpus)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        launch(Config.load(overrides=texts(cfg_overrides)))
    except _Stop:
        pass
    except ConfigError as e:
        seen["refused"] = str(e)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        os.environ.clear()
        os.environ.update(env)
    seen["files"] = tree_files(paths["{tmp}"])
    return seen


# ---- one collective, a peer late ------------------------------------------------------------------------


def _late_peer_all_reduce(comm_tree: dict, late_s: float) -> str:
    """Two calls of the all-reduce on a group of its own: both ranks in time (the first call also checks that
    the ranks agree), then rank 1 ``late_s`` late."""
    import torch.distributed as dist

    from shardwise.config import CommConfig
    from shardwise.dist.comm.compress import gradient_all_reduce
    from shardwise.dist.comm.counting import CommStats

    group = dist.new_group(list(range(dist.get_world_size())))  # a stale message stays on this group
    fn = gradient_all_reduce(CommConfig(**comm_tree), CommStats(), dist.get_world_size())
    dist.barrier(group)
    fn(torch.ones(8), group)
    if dist.get_rank() == 1:
        time.sleep(late_s)
    try:
        work = fn(torch.ones(8), group)
        if work is not None:
            work.wait()
        outcome = "ok"
    except Exception as e:  # noqa: BLE001 - the outcome is the observation
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    time.sleep(late_s if dist.get_rank() == 0 else 0)  # the late peer ends its side before the next call
    return outcome


def observe_collective(overrides: dict, paths: dict[str, Path]) -> dict:
    """The gradient all-reduce the engine builds from ``comm`` (2 ranks, dp 2), rank 1 arriving 1 s late."""
    from tests.harness import run_on_ranks

    cfg_overrides, _ = merged({**MODEL, "parallel.nproc": 2}, overrides, paths)
    cfg = resolve(Config.load(overrides=texts(cfg_overrides)), tokenizer_vocab=257)
    tree = cfg.to_dict()["comm"]
    return {"outcome": run_on_ranks(2, _late_peer_all_reduce, tree, 1.0)[0]}
