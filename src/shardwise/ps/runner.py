"""``shardwise train`` in parameter-server mode: the first W ranks are workers, the last S servers.

The training loop of :mod:`shardwise.train.loop` dispatches here when ``ps.servers > 0``. Workers shard
the data as data-parallel ranks would (``DistributedWindowSampler`` over the W workers, the same global
batch), so bsp trains exactly the model synchronous data parallelism trains. Servers are the *last* S
ranks, so global rank 0 is worker 0: it writes ``metrics.jsonl`` (its own measurements, plus the
servers' update counts as its pulls report them) and the checkpoint's JSON state. Each server writes
``ps/server<rank>.json`` at the end, each worker ``ps/worker<rank>.jsonl`` per step.

Checkpoints are the single-process state (:mod:`shardwise.train.sharded`): servers write their partitions
of the weights and of AdamW's moments, worker 0 the buffers, the RNG states and the data position; a run
resumes from them in ps mode (any S, W) or in all-reduce mode, and the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import Config
from shardwise.data import DistributedWindowSampler, prepare_corpus, val_indices
from shardwise.data.objectives import objective_windows
from shardwise.dist.mesh import default_group_timeout, init_distributed
from shardwise.model import Transformer
from shardwise.parallel.dropout import replica_key
from shardwise.parallel.expert.router_step import router_step
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.tensor import state as tp_state
from shardwise.ps import protocol
from shardwise.ps.partition import partition_model
from shardwise.ps.server import Server
from shardwise.ps.worker import Worker
from shardwise.train import state as train_state
from shardwise.train.checkpoint import verify_checkpoint
from shardwise.train.metrics import MetricsLogger
from shardwise.train.optim import build_optimizer, lr_at, set_lr
from shardwise.train.precision import autocast_context
from shardwise.train.recovery import resume_wanted
from shardwise.train.result import TrainResult
from shardwise.train.resume import agreed_resume
from shardwise.train.sharded import save_sharded, whole


def straggler(text: str) -> tuple[int, float]:
    """``"RANK:MS"`` -> (rank, seconds); ``""`` -> (-1, 0)."""
    if not text:
        return -1, 0.0
    rank, _, ms = text.partition(":")
    return int(rank), float(ms) / 1000.0


def aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every state-dict name of each parameter, keyed by its first name (tied weights have two)."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(first.setdefault(id(p), name), []).append(name)
    return out


def run_ps(cfg: Config, run_dir: Path, collect_state: bool = False, stop_after: int | None = None):
    """Train ``cfg`` (resolved, ``ps.servers > 0``) on this rank; returns a :class:`TrainResult`."""

    rank, world, _, _ = init_distributed("gloo", cfg.parallel.timeout_s)
    n_servers = cfg.ps.servers
    n_workers = world - n_servers
    if n_workers != cfg.parallel.dp:
        raise RuntimeError(f"ps.servers={n_servers} of {world} ranks leaves {n_workers} workers, but the config "
                           f"was resolved for parallel.dp={cfg.parallel.dp}")
    workers, servers = list(range(n_workers)), list(range(n_workers, world))
    worker_group = dist.new_group(workers, timeout=default_group_timeout())  # bounded as parallel.timeout_s
    server_group = dist.new_group(servers, timeout=default_group_timeout())
    run_dir, tcfg = Path(run_dir), cfg.train
    timeout = cfg.parallel.timeout_s

    if rank == 0:
        corpus = prepare_corpus(cfg.data, run_dir)
    dist.barrier()
    if rank != 0:
        corpus = prepare_corpus(cfg.data, run_dir)

    torch.manual_seed(tcfg.seed)
    model = Transformer(cfg.model)
    model.reset_parameters(tcfg.seed)
    parts = [dataclasses.replace(q, server=servers[q.server])  # server index -> its rank
             for q in partition_model(model, cfg.ps.partition_kb * 1024, n_servers)]
    codec = protocol.PushCodec(cfg.comm.compression, cfg.comm.topk_ratio)
    names = aliases(model)
    sampler = DistributedWindowSampler(len(objective_windows(cfg, corpus, "train")), tcfg.global_batch,
                                       tcfg.seed, rank if rank < n_workers else 0, n_workers)
    reader, start_step = None, 0
    log = MetricsLogger(run_dir, enabled=rank == 0, total_steps=tcfg.steps,
                        tensorboard=cfg.run.tensorboard, progress=cfg.run.progress)
    if resume_wanted(cfg.ckpt.resume):  # asked for, or the elastic agent restarted the group
        # the ranks agree on one checkpoint (train/resume.py); a server loads its partitions once it has started,
        # so here every rank verifies the whole checkpoint, not only its share, before the ranks agree on it
        def verified_step(candidate) -> int:
            verify_checkpoint(candidate.path)
            return int(candidate.meta["step"])

        resumed = agreed_resume(run_dir / "checkpoints", verified_step, required=cfg.ckpt.resume,
                                warn=log.log_event if rank == 0 else (lambda _m: None))
        if resumed is not None:
            reader, start_step = train_state.open_checkpoint(resumed.path), resumed.step
            log.log_event(f"resumed from {resumed.path} at step {start_step} (parameter server)")
    log.start_step = start_step

    def save(step: int) -> None:
        """The checkpoint at ``step``: a collective of every rank (servers and workers)."""
        rng = train_state.gather_rng_states()
        pieces, meta = [], None
        if rank in servers:
            pieces = server.checkpoint_pieces(names)
        elif rank == 0:
            params = {n for group in names.values() for n in group}
            pieces = [whole(f"model/{k}", v) for k, v in model.state_dict().items() if k not in params]
            pieces += train_state.rng_pieces(rng)
            optimizer = build_optimizer(model, tcfg)
            set_lr(optimizer, lr_at(max(step - 1, 0), tcfg))
            meta = train_state.capture_meta(optimizer.state_dict()["param_groups"], None, sampler, step, cfg)
        save_sharded(run_dir / "checkpoints", step, pieces, meta, keep=cfg.ckpt.keep)

    result = TrainResult(losses=[], val_loss=None, final_step=start_step, state_dict={})
    if rank in servers:
        mine = [q for q in parts if q.server == rank]
        server = Server(mine, dict(model.named_parameters()), workers, tcfg, cfg.ps.consistency, cfg.ps.staleness,
                        codec, server_group if n_servers > 1 else None, timeout, start_clock=start_step)
        if reader is not None:
            server.load(reader.model_state(), reader.optimizer_state())
        server.on_checkpoint = save
        server.serve()
        (run_dir / "ps").mkdir(exist_ok=True)
        (run_dir / "ps" / f"server{rank}.json").write_text(json.dumps(server.stats()))
        local_losses: list[float] = []
    else:
        if reader is not None:
            sampler.load_state_dict(reader.meta["data"])
            train_state.restore_rng(reader, rank)
        local_losses, done = _work(cfg, run_dir, model, parts, codec, sampler, corpus, worker_group, log, save,
                                   start_step, stop_after)
        result.final_step = done
        result.val_loss = _evaluate(model, objective_windows(cfg, corpus, "val"), tcfg, rank,
                                    n_workers, worker_group)
        if rank == 0 and result.val_loss is not None:
            log.log(done, {"val_loss": result.val_loss})
    log.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, local_losses)
    per_worker = everyone[:n_workers]
    result.losses = [sum(ls) / len(ls) for ls in zip(*per_worker, strict=True)]
    result.worker_losses = per_worker
    if collect_state:
        result.state_dict = _gather_state(model, server if rank in servers else None, names, rank)
    return result


def _work(cfg, run_dir, model, parts, codec, sampler, corpus, worker_group, log, save, start_step, stop_after):
    """A worker's training loop; returns its per-step losses and the last step done."""
    tcfg, ps = cfg.train, cfg.ps
    rank = dist.get_rank()
    lag_rank, lag_s = straggler(ps.straggler)
    apply_recompute(model, tcfg.recompute, tcfg.recompute_every)  # the worker's replica, as the engine does
    worker = Worker(model, parts, codec, ps.scheduling, ps.credit_kb * 1024, cfg.parallel.timeout_s,
                    delay_s=lag_s if rank == lag_rank else 0.0)
    worker.clock = start_step
    windows = objective_windows(cfg, corpus, "train")  # next-token windows, masked windows (mlm) or labelled ones
    val_windows = objective_windows(cfg, corpus, "val")
    n_workers = dist.get_world_size(worker_group)
    own_log = (run_dir / "ps" / f"worker{rank}.jsonl")
    own_log.parent.mkdir(exist_ok=True)
    losses, done = [], start_step
    with own_log.open("a") as f:
        for step in range(start_step, tcfg.steps):
            t0 = time.perf_counter()
            batches = [windows.batch(ids) for ids in sampler.micro_batches(step, tcfg.micro_batch)]
            key = replica_key(tcfg.seed, step, rank, tcfg.global_batch, n_workers) if cfg.model.dropout else None
            loss, norm = worker.step(batches, tcfg.precision, asp=ps.consistency == "asp", dropout_key=key)
            done = step + 1
            losses.append(loss)
            metrics = {"loss": loss, "lr": lr_at(step, tcfg), "grad_norm": norm, **worker.pop_metrics()}
            if cfg.model.n_experts:  # the router's load and losses: over every worker in lock-step, else its own
                metrics.update(router_step(model, worker_group if ps.consistency == "bsp" else None)())
            if ps.consistency == "bsp":  # workers are in lock-step anyway: report the global batch's loss
                mean = torch.tensor([loss], dtype=torch.float64)
                protocol.wait(dist.all_reduce(mean, group=worker_group, async_op=True), cfg.parallel.timeout_s,
                              f"ps worker rank {rank}: the other workers' losses of step {done}")
                metrics["loss"], metrics["worker_loss"] = float(mean) / n_workers, loss
            elapsed = time.perf_counter() - t0  # with bsp the lock-step wait for the slowest worker included
            metrics.update(step_time_s=elapsed,
                           tokens_per_s=tcfg.micro_batch * tcfg.grad_accum * cfg.data.seq_len / elapsed)
            if tcfg.eval_every and done % tcfg.eval_every == 0 and done < tcfg.steps:
                worker.pull(done)  # the weights the next step starts from
                val = _evaluate(model, val_windows, tcfg, rank, n_workers, worker_group)
                if val is not None:
                    metrics["val_loss"] = val
            f.write(json.dumps({"step": done, **metrics}) + "\n")
            log.log(done, metrics)
            if done == tcfg.steps or (cfg.ckpt.every and done % cfg.ckpt.every == 0):
                worker.control(protocol.CKPT, done)
                save(done)
            if stop_after is not None and done >= stop_after:
                break
    worker.pull(done, final=True)  # every worker's pushes applied: the run's final weights
    worker.control(protocol.STOP, done)
    worker.scheduler.close()
    return losses, done


@torch.no_grad()
def _evaluate(model, windows, tcfg, rank: int, n_workers: int, group) -> float | None:
    """Mean validation loss over the held-out windows, split over the workers (a collective of theirs)."""
    model.eval()
    ids = val_indices(len(windows), tcfg.eval_batches * tcfg.global_batch, rank, n_workers)
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(ids), tcfg.micro_batch):
        x, y = windows.batch(ids[start:start + tcfg.micro_batch])
        with autocast_context(tcfg.precision, "cpu"):
            total[0] += model(x, y).double() * x.shape[0]
        total[1] += x.shape[0]
    dist.all_reduce(total, group=group)
    model.train()
    return float(total[0] / total[1]) if total[1] else None


def _gather_state(model, server: Server | None, names: dict[str, list[str]], rank: int) -> dict[str, torch.Tensor]:
    """The whole model on rank 0: the servers' partitions written over worker 0's state (which brings the
    buffers); a world collective (:func:`shardwise.parallel.tensor.state.gather_pieces`)."""
    mine = [p for p in server.checkpoint_pieces(names) if p.key.startswith("model/")] if server is not None else []
    if rank == 0:  # a worker: the servers are the last ranks, so their pieces land after these
        mine = [whole(f"model/{k}", v.detach()) for k, v in model.state_dict().items()] + mine
    return tp_state.gather_pieces(mine)
