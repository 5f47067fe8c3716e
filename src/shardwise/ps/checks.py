"""The config rules of the parameter server, functions of the config alone (no torch)."""

from __future__ import annotations

from shardwise.checks import Unused, choice, positive
from shardwise.config import Config, ConfigError


def worker_world(cfg: Config, world: int) -> int:
    """The ranks data parallelism is resolved over: with ``ps.servers`` S, the world minus its last S ranks
    (the servers, :mod:`shardwise.ps`); the data is sharded over the workers."""
    s, p = cfg.ps.servers, cfg.parallel
    positive("ps.servers", s, allow_zero=True)
    if not s:
        return world
    if s >= world:
        raise ConfigError(f"ps.servers={s} leaves no worker among the {world} ranks; use at most {world - 1} "
                          f"or raise parallel.nproc")
    for dotted, value, off in [("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1), ("parallel.cp", p.cp, 1),
                               ("parallel.ep", p.ep, 1), ("parallel.zero", p.zero, 0)]:
        if value != off:  # checked first: the other layout checks would count the servers' ranks
            raise ConfigError(f"ps.servers={s} with {dotted}={value}: the parameter server's workers hold "
                              f"whole replicas; use {dotted}={off} or ps.servers=0")
    return world - s


def check(cfg: Config) -> None:
    """The parameter server's own checks, and what it does not compose with (one line each)."""
    ps, p, t = cfg.ps, cfg.parallel, cfg.train
    choice("ps.consistency", ps.consistency)
    choice("ps.scheduling", ps.scheduling)
    positive("ps.staleness", ps.staleness, allow_zero=True)
    positive("ps.partition_kb", ps.partition_kb)
    positive("ps.credit_kb", ps.credit_kb)
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
    if cfg.run.device == "cuda":
        raise ConfigError(f"ps.servers={ps.servers} with run.device='cuda': the parameter server's pushes and pulls "
                          "are gloo point-to-point, which takes CPU tensors only; use run.device='cpu'")
    if t.precision == "fp16":
        raise ConfigError(f"ps.servers={ps.servers} with train.precision='fp16': the loss scaler's skipped steps "
                          "would need every worker to agree; use train.precision='bf16' or 'fp32'")
    if cfg.model.init_from:
        raise ConfigError(f"ps.servers={ps.servers} with model.init_from={cfg.model.init_from!r}: the parameter "
                          "server starts from the seed's initialisation for now; remove model.init_from or use "
                          "ps.servers=0")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def unused(cfg: Config) -> list[Unused]:
    ps = cfg.ps
    on = "ps.servers=0 (no parameter server); set ps.servers >= 1 or remove it"
    return [
        Unused("ps.consistency", ps.servers, f"chooses the parameter server's consistency, but {on}"),
        Unused("ps.staleness", ps.consistency == "ssp", f"bounds ps.consistency='ssp', but ps.consistency="
               f"{ps.consistency!r}; set ps.consistency='ssp' or remove it"),
        Unused("ps.partition_kb", ps.servers, f"sizes the parameter server's partitions, but {on}"),
        Unused("ps.scheduling", ps.servers, f"orders the parameter server's pushes, but {on}"),
        Unused("ps.credit_kb", ps.scheduling == "priority", f"is the credit of ps.scheduling='priority', but "
               f"ps.scheduling={ps.scheduling!r}; set ps.scheduling='priority' or remove it"),
        Unused("ps.straggler", ps.servers, f"delays a parameter-server worker, but {on}"),
        Unused("parallel.bucket_mb", not ps.servers, f"sizes all-reduce buckets, but ps.servers={ps.servers} pushes "
               "partitions; set ps.partition_kb instead"),
        Unused("comm.algorithm", not ps.servers, f"is an all-reduce algorithm, but ps.servers={ps.servers} pushes to "
               "servers point to point; use comm.algorithm='native'"),
    ]
