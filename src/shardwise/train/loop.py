"""The training loop: one function run by every worker process.

config → mesh → model → parallelize → loop → metrics / checkpoints. Every layout trains the
same model as a single process given the same seed and global batch: the data order is a
function of the optimizer step only (see ``DistributedWindowSampler``), initialisation depends
only on the seed, and the loss of a step is the mean over the whole global batch.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import Config
from shardwise.data import DistributedWindowSampler, TokenWindows, prepare_corpus, val_indices
from shardwise.data.objectives import objective_windows
from shardwise.dist.clock import clock_for
from shardwise.dist.mesh import ParallelDims, init_distributed
from shardwise.model import Transformer
from shardwise.parallel.context import shard_windows
from shardwise.parallel.expert.router_step import CollapseWatch
from shardwise.train import memory as train_memory
from shardwise.train import state as train_state
from shardwise.train.ckpt_writer import CheckpointWriter
from shardwise.train.engine import Engine
from shardwise.train.faults import FaultPlan
from shardwise.train.flops import peak_flops, training_flops_per_token
from shardwise.train.metrics import MetricsLogger, process_memory_bytes
from shardwise.train.optim import DeviceLrSchedule, lr_at
from shardwise.train.precision import DynamicLossScaler
from shardwise.train.readout import Readout, ReadStep, resolve_late
from shardwise.train.recovery import clean_partial_checkpoints, note_restart, resume_wanted
from shardwise.train.result import TrainResult
from shardwise.train.resume import agreed_resume
from shardwise.train.step_guard import SkippedStepsError, StepGuard, nonfinite_sources, skip_line


def train(cfg: Config, run_dir: Path, collect_state: bool = False, stop_after: int | None = None) -> TrainResult:
    """Train according to ``cfg`` (already resolved) in the current process.

    Joins the default process group if one exists (torchrun, the launcher or the test
    harness made it), otherwise creates a one-process group. ``collect_state`` returns the final
    weights; ``stop_after`` ends the run after that optimizer step as an interruption would
    (the schedule still spans ``train.steps``), for resume tests.
    """
    if cfg.ps.servers:
        raise ValueError("ps.servers > 0 trains with the parameter server's runner; start it with "
                         "shardwise.worker.train, which picks the runner")
    rank, world, _local_rank, device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, cfg.run.device)
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = dims.build(device.type)
    dp_rank, dp_size = mesh.dp_rank, mesh.dp_size
    loss_group = mesh.group("dp_cp")  # validation losses are averaged over dp x cp
    run_dir = Path(run_dir)
    tcfg = cfg.train

    # Data: the parent process prepared the cache; here it is a cache hit (rank 0 first, for plain torchrun).
    if rank == 0:
        corpus = prepare_corpus(cfg.data, run_dir)
    dist.barrier()
    if rank != 0:
        corpus = prepare_corpus(cfg.data, run_dir)
    # what the objective reads (windows; masked for mlm; labelled for classify); with context parallelism
    # each cp rank reads its replica's windows and keeps its part of every sequence
    train_windows = shard_windows(objective_windows(cfg, corpus, "train"), mesh, cfg)
    val_windows = shard_windows(objective_windows(cfg, corpus, "val"), mesh, cfg)
    sampler = DistributedWindowSampler(len(train_windows), tcfg.global_batch, tcfg.seed, dp_rank, dp_size)

    # Model and techniques: every rank builds what it holds from the seed, composed in one order (train/engine.py).
    engine = Engine(cfg, mesh, device, run_dir)
    optimizer = engine.optimizer
    scaler = DynamicLossScaler(tcfg.fp16_init_scale, growth_interval=tcfg.fp16_growth_interval, device=device) \
        if tcfg.precision == "fp16" else None

    start_step, skipped_before = 0, 0
    log = MetricsLogger(run_dir, enabled=rank == 0, total_steps=tcfg.steps,
                        tensorboard=cfg.run.tensorboard, progress=cfg.run.progress)
    ckpt_root = run_dir / "checkpoints"
    writer = CheckpointWriter(ckpt_root, cfg.ckpt.keep, cfg.ckpt.async_, cfg.parallel.timeout_s)
    faults = FaultPlan(cfg.run.fault, rank)  # test-only injected failures (train/faults.py)
    if rank == 0:
        clean_partial_checkpoints(ckpt_root, log.log_event)
    if cfg.model.init_from:  # pretrained weights, loaded layout-free; a checkpoint resumed below replaces them
        from shardwise.hf.init import init_from_pretrained

        log.log_event(init_from_pretrained(engine, cfg))
    resumed = None
    if resume_wanted(cfg.ckpt.resume):  # asked for, or the elastic agent restarted the group
        # the ranks agree on one checkpoint and each reads (and verifies) its share (train/resume.py); one
        # that not every rank can verify is kept aside, never overwritten
        resumed = agreed_resume(ckpt_root, lambda reader: train_state.restore(reader, engine, scaler, sampler, rank),
                                required=cfg.ckpt.resume, warn=log.log_event if rank == 0 else (lambda _m: None))
        if resumed is not None:
            start_step = resumed.step
            skipped_before = int(resumed.reader.meta.get("skipped_steps", 0))
            log.log_event(f"resumed from {resumed.path} at step {start_step} (agreed by all {world} ranks; "
                          f"{sum(resumed.bytes_read.values()):,} bytes read here, at most "
                          f"{resumed.max_rank_bytes:,} on one rank)")
            changed = schedule_change(resumed.reader.meta.get("config", {}).get("train", {}), tcfg, start_step)
            if changed:
                log.log_event(changed)
        else:
            log.log_event(f"no checkpoint in {ckpt_root} verifies on every rank; starting from step 0")
    log.start_step = start_step
    note_restart(log, run_dir, start_step, cfg.run.max_restarts)  # a restarted group logs what was lost

    with torch.device("meta"):
        n_params = Transformer(cfg.model).num_parameters()
    flops_per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops(device, tcfg.precision, tcfg.peak_flops)
    tokens_per_step = tcfg.global_batch * cfg.data.seq_len
    if rank == 0:
        log.log_event(
            f"model {cfg.model.preset} ({cfg.model.flavor}): {n_params / 1e6:.2f}M parameters; "
            f"{engine.describe()}; global batch {tcfg.global_batch} = micro {tcfg.micro_batch} x accum "
            f"{tcfg.grad_accum} x dp {dp_size}; {len(train_windows)} training windows of {cfg.data.seq_len} tokens"
        )

    losses: list[float] = []
    grad_norms: list[float] = []
    skipped_steps: list[int] = []
    val_loss = None
    if start_step == 0:  # the untrained model's validation loss: the baseline the run improves on
        val_loss = evaluate(engine, val_windows, tcfg, dp_rank, dp_size, loss_group, device)
        if val_loss is None:
            log.log_event(f"the validation split holds {len(val_windows)} windows of {cfg.data.seq_len} tokens, too "
                          "few for every rank: no val_loss (raise data.val_fraction or use a larger corpus)")
        else:
            log.log(0, {"val_loss": val_loss})
    wanted = tcfg.eval_batches * tcfg.global_batch
    if len(val_windows) < wanted:
        used = len(val_windows) // dp_size * dp_size
        log.log_event(f"the validation split holds {len(val_windows)} windows, fewer than train.eval_batches x "
                      f"train.global_batch = {wanted}: val_loss is over the first {used}, a set that depends on "
                      "the data-parallel size (raise data.val_fraction to compare layouts)")
    done = start_step
    collapse = CollapseWatch(cfg.model.n_experts or 0, cfg.model.moe_top_k)  # MoE: warns of a router collapse
    guard = StepGuard(tcfg.max_skipped_steps, device, skipped=skipped_before)  # skips bad steps on every rank
    lr_schedule = DeviceLrSchedule(tcfg, device)  # lr_at(applied steps), chosen on the device
    readout = Readout(device)  # the step's device values, read one step late: the step never waits for them

    def finish(read: ReadStep) -> None:
        """Step ``read.step``'s values have reached the host: log it; count it, name it and maybe stop if skipped."""
        values = read.values
        skipped = values["skipped"] > 0
        guard.note(read.step, skipped)
        losses.append(values["loss"])
        grad_norms.append(values["grad_norm"])
        metrics = {"loss": values["loss"], "lr": values["lr"], "grad_norm": values["grad_norm"],
                   **resolve_late(read.keep["metrics"]), "skipped_steps": float(guard.total)}
        if scaler:
            metrics["loss_scale"] = values["loss_scale"]
        log.log(read.step, metrics)
        if cfg.model.n_experts and (note := collapse.check(read.step, metrics)):
            log.log_event(note)
        if not skipped:
            return
        skipped_steps.append(read.step)
        sources = nonfinite_sources(read.keep["loss"], read.keep["micro_losses"]) if values["nonfinite"] else []
        log.log_event(skip_line(read.step, values, sources, guard, tcfg.skip_grad_norm_above))
        if guard.exhausted:
            writer.wait()  # a checkpoint being written (of an applied step) is completed, not left half-written
            last = guard.last_applied
            applied = f"the last applied step is {last}" if last is not None else "no step of this attempt was applied"
            raise SkippedStepsError(
                f"stopped at step {read.step}: {guard.streak} consecutive steps skipped (train.max_skipped_steps="
                f"{guard.max_skipped}); {applied}, and no checkpoint was written after it. Lower train.lr, use "
                "train.grad_clip or look for bad data")

    for step in range(start_step, tcfg.steps):
        t0 = time.perf_counter()
        done = step + 1
        lr = lr_schedule.set(optimizer, step, guard.skipped)
        batches = [tuple(_to_device(t, device) for t in train_windows.batch(ids))
                   for ids in sampler.micro_batches(step, tcfg.micro_batch)]
        replica_loss = faults.poison_loss(done, engine.forward_backward(batches, tcfg.precision, scaler, step))
        faults.poison_gradient(done, engine.grad_pieces)
        verdict = engine.check_step(replica_loss, scaler, tcfg.grad_clip, tcfg.skip_grad_norm_above)
        ckpt_wait = writer.before_update()  # a background checkpoint copies the weights before they change
        guard.apply(optimizer, verdict, scaler)  # the optimizer step, or nothing at all, decided on the device
        first = done == start_step + 1  # the optimizer state exists from here: print the start-up table
        accounted, accounting_s = None, 0.0
        if first or done == tcfg.steps or done % 10 == 0:  # measured while gradients and moments both exist
            t_acc = time.perf_counter()
            accounted = engine.memory_bytes()
            accounting_s = time.perf_counter() - t_acc  # not part of the training step's time
        optimizer.zero_grad(set_to_none=True)

        elapsed = time.perf_counter() - t0 - accounting_s  # the step's launches (and, on a CPU, its work)
        metrics = {"tokens_per_s": 0.0, "step_time_s": 0.0, "mfu": 0.0,  # with the wait below
                   **engine.comm_metrics(),  # a pipeline's timeline: gathered on the steps that account memory
                   **engine.step_metrics(skipped=verdict.skip, timeline=accounted is not None)}
        for _, write_s in writer.finished():  # a background checkpoint write that ended during this step
            metrics["ckpt_write_s"] = write_s
        if ckpt_wait is not None:
            metrics["ckpt_wait_s"] = ckpt_wait
        if done == tcfg.steps or (tcfg.eval_every and done % tcfg.eval_every == 0):
            val_loss = evaluate(engine, val_windows, tcfg, dp_rank, dp_size, loss_group, device)
            if val_loss is not None:
                metrics["val_loss"] = val_loss
        if accounted is not None:
            metrics.update({f"mem_{k}": float(v) for k, v in process_memory_bytes().items()})
            engine.write_timeline(run_dir, done)
            metrics.update({f"mem_{k}_bytes": float(v) for k, v in accounted.items()})
        if first and rank == 0 and engine.comm_choices():
            log.log_event("comm.algorithm=auto chose " + ", ".join(
                f"{alg} for {size} B buckets" for size, alg in sorted(engine.comm_choices().items())))
        if first:
            per_rank = train_memory.gather_per_rank(accounted)
            title = f"model-state bytes per rank ({engine.describe()})"
            log.log_event(train_memory.format_table(per_rank, title=title))
        values = {"loss": verdict.loss, "lr": lr, "grad_norm": verdict.grad_norm, "skipped": verdict.skip,
                  "nonfinite": verdict.nonfinite, "spike": verdict.spike}
        if scaler:
            values["loss_scale"] = scaler.scale_tensor
        readout.push(done, values, metrics=metrics, loss=replica_loss, micro_losses=engine.micro_losses())
        save = done == tcfg.steps or (cfg.ckpt.every and done % cfg.ckpt.every == 0)
        stop = stop_after is not None and done >= stop_after
        # the previous step's values are read now, while this step's work keeps the device busy; before a
        # checkpoint, an injected failure or the end, this step's too. Waiting for them paces the loop to the
        # device: the step's time is its launches plus that wait (on a CPU the wait is nil)
        t_read = time.perf_counter()
        reads = readout.drain() if save or stop or faults.fires_after(done) else readout.ready()
        step_s = elapsed + time.perf_counter() - t_read
        metrics.update(tokens_per_s=tokens_per_step / step_s, step_time_s=step_s,
                       mfu=tokens_per_step / step_s * flops_per_token / (peak * world) if peak else 0.0)
        for read in reads:
            finish(read)
        faults.after_step(done)
        if save and guard.streak:  # the newest checkpoint stays the last applied step's
            log.log_event(f"checkpoint {done} not written: step {done} was skipped ({guard.streak} in a row)")
        elif save:
            record = {"ckpt_stall_s": _save(cfg, writer, done, engine, scaler, sampler, rank, guard.total,
                                            faults.during_save(done))}
            for _, write_s in writer.finished():  # a synchronous write ends before training goes on
                record["ckpt_write_s"] = write_s
            log.log(done, record)
        if stop:
            break
    for read in readout.drain():
        finish(read)
    engine.settle()  # no gather of the last step left travelling
    writer.wait()  # the last checkpoint is complete before the run ends
    for step, write_s in writer.finished():
        log.log(step, {"ckpt_write_s": write_s})
    log.close()
    full = engine.final_state_dict() if collect_state else {}
    state = {k: v.detach().cpu().clone() for k, v in full.items()}
    return TrainResult(losses=losses, val_loss=val_loss, final_step=done, state_dict=state, grad_norms=grad_norms,
                       skipped_steps=skipped_steps,
                       resume_bytes_read=resumed.bytes_read if resumed is not None else {})


SCHEDULE_FIELDS = ("steps", "lr", "min_lr", "warmup_steps")
"""The train fields the learning-rate schedule (:func:`shardwise.train.optim.lr_at`) depends on."""


def schedule_change(saved: dict, tcfg, step: int) -> str | None:
    """One line when a resumed run's learning rate from ``step`` on differs from the checkpointed run's
    (``saved``: that run's resolved ``train`` section), e.g. because train.steps changed and the cosine
    decay now spans another length; None when the schedule is the same."""
    was = {k: saved[k] for k in SCHEDULE_FIELDS if k in saved and saved[k] != getattr(tcfg, k)}
    if not was:
        return None
    old = dataclasses.replace(tcfg, **was)
    if all(lr_at(s, old) == lr_at(s, tcfg) for s in range(step, max(old.steps, tcfg.steps))):
        return None
    changes = ", ".join(f"train.{k}={getattr(tcfg, k)} (was {v})" for k, v in was.items())
    return f"resuming step {step} with {changes}: the learning-rate schedule after step {step} differs " \
           "from the original run's"


@torch.no_grad()
def evaluate(engine, windows: TokenWindows, tcfg, dp_rank: int, dp_size: int, group, device) -> float | None:
    """Mean validation loss over a fixed set of held-out windows, split across data-parallel ranks
    (None when the validation split is too small to give every rank a window)."""
    engine.train_mode(False)
    ids = val_indices(len(windows), tcfg.eval_batches * tcfg.global_batch, dp_rank, dp_size)
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for start in range(0, len(ids), tcfg.micro_batch):
        x, y = windows.batch(ids[start:start + tcfg.micro_batch])
        loss = engine.eval_loss(x.to(device), y.to(device), tcfg.precision)
        total[0] += loss.double() * x.shape[0]
        total[1] += x.shape[0]
    dist.all_reduce(total, group=group)
    engine.train_mode(True)
    return float(total[0] / total[1]) if total[1] else None


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on the training device; to a GPU from pinned memory, without waiting (a copy from pageable
    memory waits for the device)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _save(cfg, writer, step, engine, scaler, sampler, rank, skipped_steps, after_write=None) -> float:
    """Every rank writes the pieces of the single-process state it holds (train/sharded.py): whole
    tensors from data-parallel rank 0, slices of its shard from every ZeRO rank, its layers from each
    pipeline stage; global rank 0 adds every rank's RNG state and the JSON state. Layout-free: the
    checkpoint resumes on any other layout. With ``ckpt.async`` the write goes on in the background
    (train/ckpt_writer.py). Returns the seconds training stood still."""
    clock = clock_for(engine.device)  # the device's time: what the step stood still (shardwise.dist.clock)
    start = clock.stamp()
    rng_states = train_state.gather_rng_states()
    pieces, param_groups = engine.checkpoint_pieces()
    meta = None
    if rank == 0:
        pieces = pieces + train_state.rng_pieces(rng_states)
        meta = train_state.capture_meta(param_groups, scaler, sampler, step, cfg, skipped_steps)
    writer.save(step, pieces, meta, after_write=after_write)
    return clock.elapsed(start, clock.stamp())
