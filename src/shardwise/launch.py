"""Start a training run: validate, prepare data once, then spawn the workers.

The order is the promise that bad input loses nothing: the whole config is validated and the
corpus tokenized in this (parent) process before any worker starts. Workers are spawned through
torch's elastic launcher (torchrun semantics: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT);
on several machines run ``torchrun --nnodes ... -m shardwise.train`` instead, which enters
:func:`shardwise.train.__main__.main` on every rank.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shlex
import signal
import sys
import uuid
from pathlib import Path

from shardwise import run_dir as run_dir_policy
from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve


class WorkerFailed(RuntimeError):
    """A worker process raised; the message is the failing rank's exception line."""

    def __init__(self, message: str, traceback_text: str = ""):
        super().__init__(message)
        self.traceback_text = traceback_text


class Interrupted(Exception):
    """The run was stopped by a signal (Ctrl-C: SIGINT; SIGTERM); the message says where it stood and
    the command that continues it. ``exit_code`` is the shell's convention, 128 + the signal number."""

    def __init__(self, run_dir: Path, signum: int = signal.SIGINT):
        self.run_dir, self.signum = Path(run_dir), int(signum)
        super().__init__(interruption_text(self.run_dir, self.signum))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interruption_text(run_dir: Path, signum: int = signal.SIGINT) -> str:
    """"interrupted at step N; the newest checkpoint is step M -- continue with `shardwise train
    RUN_DIR/config.toml --resume`": the last step in metrics.jsonl, the newest valid checkpoint."""
    from shardwise.train.checkpoint import latest_valid_checkpoint, verify_structure

    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    steps = [r["step"] for r in _records(run_dir) if "loss" in r]
    where = f"{what} at step {steps[-1]}" if steps else f"{what} before the first step"
    newest = latest_valid_checkpoint(run_dir / "checkpoints", warn=lambda _m: None, check=verify_structure)
    command = f"shardwise train {shlex.quote(str(run_dir / 'config.toml'))} --resume"
    if newest is None:
        return f"{where}; no checkpoint was written yet -- `{command}` starts it again from step 0"
    return f"{where}; the newest checkpoint is step {int(newest.name.rpartition('_')[2])} -- continue with `{command}`"


def _records(run_dir: Path) -> list[dict]:
    from shardwise.train.metrics import read_metrics

    try:
        return read_metrics(run_dir)
    except FileNotFoundError:
        return []


def resolve_run_dir(cfg: Config) -> Path:
    """The run directory: ``run.dir`` if set; for a resume without one, ``runs/latest``;
    otherwise a new ``runs/<preset>-<date>-<time>`` (``-2``, ``-3``, ... when two runs start in one second)."""
    if cfg.run.dir:
        return Path(cfg.run.dir)
    latest = Path("runs") / "latest"
    if cfg.ckpt.resume:
        if not latest.exists():
            raise ConfigError("ckpt.resume=true but run.dir is not set and runs/latest does not exist; give --run.dir")
        return latest.resolve()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = Path("runs") / f"{cfg.model.preset}-{stamp}", 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{cfg.model.preset}-{stamp}-{n}"
    return path


def prepare_run(cfg: Config, world_size: int | None = None) -> tuple[Config, Path]:
    """Validate ``cfg``, tokenize its corpus (cached) and write the resolved config into the run dir.

    Everything that can be checked before a worker starts is checked before anything is written
    (:mod:`shardwise.run_dir`): a run directory that already holds a run is refused unless resumed, and a
    resume must find a checkpoint that verifies and fits the config's model. ``config.toml`` is written
    last, atomically, once training can start."""
    from shardwise.data import DistributedWindowSampler, TokenWindows, prepare_corpus
    from shardwise.train.faults import restart_attempt

    checked = resolve(cfg, world_size=world_size)  # fail fast, before any tokenization
    run_dir = resolve_run_dir(checked)
    run_dir_policy.check_path(run_dir)
    if not checked.ckpt.resume and restart_attempt() == 0:  # a torchrun restart re-enters with its own run
        run_dir_policy.check_new_run(run_dir)
    corpus = prepare_corpus(checked.data, None)
    resolved = resolve(cfg, world_size=world_size, tokenizer_vocab=corpus.vocab_size)
    # The corpus must hold at least one global batch of windows: checked here, not in every worker.
    windows = TokenWindows(corpus.train_path, resolved.data.seq_len)
    DistributedWindowSampler(len(windows), resolved.train.global_batch, resolved.train.seed)
    if resolved.ckpt.resume:
        run_dir_policy.check_resume(run_dir, resolved, log=lambda line: print(line, file=sys.stderr))
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_corpus(checked.data, run_dir)  # a cache hit that copies the tokenizer into the run
    resolved.run.dir = str(run_dir)
    run_dir_policy.write_config(run_dir, resolved.to_toml())
    return resolved, run_dir


def launch(cfg: Config, debug: bool = False) -> Path:
    """Run the training job of ``cfg`` on ``parallel.nproc`` local workers (this node's share of
    ``parallel.nnodes`` nodes, see :mod:`shardwise.dist.nodes`); returns the run dir."""
    p = cfg.parallel
    if p.nnodes > 1 and not (p.rdzv_endpoint and cfg.run.dir):
        raise ConfigError(f"parallel.nnodes={p.nnodes} needs parallel.rdzv_endpoint=HOST:PORT (an address of one "
                          "node) and run.dir (a directory every node shares), the same on every node")
    resolved, run_dir = prepare_run(cfg)
    nproc = resolved.parallel.nproc
    # runs/latest moves to a new default run directory once it holds a checkpoint, not before
    latest = run_dir_policy.LatestLink(run_dir, enabled=not cfg.run.dir and run_dir.parent == Path("runs"))
    try:
        with latest:
            if nproc == 1 and p.nnodes == 1 and not cfg.run.max_restarts:  # one in-process worker
                from shardwise.worker import train

                train(resolved, run_dir)
            else:
                _spawn(resolved, run_dir, nproc, debug)
    except KeyboardInterrupt:
        raise Interrupted(run_dir, signal.SIGINT) from None
    return run_dir


def _spawn(cfg: Config, run_dir: Path, nproc: int, debug: bool) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardwise.dist.mesh import free_port
    from shardwise.dist.nodes import node_settings
    from shardwise.train.recovery import GAVE_UP_FILE

    p = cfg.parallel
    rdzv = dict(run_id=f"shardwise-{uuid.uuid4().hex[:8]}", rdzv_endpoint=f"127.0.0.1:{free_port()}")
    if p.nnodes > 1:
        node = node_settings(p.rdzv_endpoint, cfg.run.dir)
        if node.ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", node.ifname)  # gloo's interface: the one reaching HOST
        rdzv = dict(run_id=node.run_id, rdzv_endpoint=node.endpoint, local_addr=node.local_addr,
                    rdzv_configs={"is_host": node.is_host, "join_timeout": p.rdzv_timeout_s,
                                  "read_timeout": p.rdzv_timeout_s})
    launch_cfg = LaunchConfig(
        min_nodes=p.nnodes,
        max_nodes=p.nnodes,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        max_restarts=cfg.run.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=5,  # SIGTERM -> SIGKILL: a stopped (SIGSTOP) peer ignores SIGTERM; state is on disk
        **rdzv,
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if not debug:  # the launcher's own log lines repeat the worker's error (and its "Terminating process ...
        # via signal SIGTERM" come before it); WorkerFailed says it once, first; --debug shows them all
        import torch.multiprocessing.spawn  # noqa: F401 - creates its logger, which the loop below quiets

        for name in [n for n in logging.root.manager.loggerDict
                     if n.startswith(("torch.distributed.elastic", "torch.multiprocessing"))]:
            logging.getLogger(name).setLevel(logging.CRITICAL)  # its modules set levels of their own
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    gave_up = run_dir / GAVE_UP_FILE
    gave_up.unlink(missing_ok=True)
    try:
        elastic_launch(launch_cfg, worker_entry)(cfg.to_dict(), str(run_dir))
        if gave_up.is_file():
            raise WorkerFailed(json.loads(gave_up.read_text(encoding="utf-8"))["cause"])
    except SignalException as e:  # the launcher stops the workers (SIGTERM), then raises this
        raise Interrupted(run_dir, e.sigval) from None
    except RendezvousError as e:  # unreachable endpoint, or fewer than nnodes nodes joined in time
        raise WorkerFailed(f"rendezvous at parallel.rdzv_endpoint={p.rdzv_endpoint or 'local'} failed "
                           f"(parallel.nnodes={p.nnodes}, parallel.rdzv_timeout_s={p.rdzv_timeout_s:g}): "
                           f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message, trace = _failure_text(failure)
        after = f" (after {cfg.run.max_restarts} restart(s))" if cfg.run.max_restarts else ""
        raise WorkerFailed(f"worker rank {rank} failed{after}: {message}", trace) from None


def worker_entry(cfg_tree: dict, run_dir: str) -> None:
    """Body of each spawned worker (module-level so the spawn start method can import it)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from shardwise.dist.diagnose import diagnosed, run_dir_recorder
    from shardwise.dist.mesh import shutdown_distributed
    from shardwise.train.recovery import give_up, repeated_failure
    from shardwise.worker import train

    def run() -> None:
        cause = repeated_failure(Path(run_dir))
        if cause is not None:  # every worker reads the same file: the whole group stops here, cleanly
            give_up(Path(run_dir), cause)
            return
        # a failed collective names itself and the ranks that did not answer; every failure is recorded
        # in RUN_DIR/failures.jsonl for the restarted group to report (train/recovery.py)
        diagnosed(lambda: train(Config.from_dict(cfg_tree), Path(run_dir)), run_dir_recorder(Path(run_dir)))
        shutdown_distributed()

    # Ctrl-C reaches every process of the terminal's group (and the launcher passes it on): a worker just
    # ends, without a KeyboardInterrupt traceback per rank; the parent says where the run stood
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    record(run)()


def _failure_text(failure) -> tuple[str, str]:
    msg = failure.message
    if isinstance(msg, dict):
        inner = msg.get("message", msg)
        text = inner.get("message", str(inner)) if isinstance(inner, dict) else str(inner)
        trace = inner.get("extraInfo", {}).get("py_callstack", "") if isinstance(inner, dict) else ""
        return text.strip().splitlines()[-1] if text.strip() else "unknown error", trace
    if isinstance(msg, str) and msg.strip():
        return msg.strip().splitlines()[-1], msg
    return f"exit code {failure.exitcode}", ""
