"""Training with delayed gradients in one process: the trajectory a parameter server follows when a
worker reads weights a fixed number of clocks old.

Bounded-delay SGD (Langford, Smola & Zinkevich, NIPS 2009, "Slow learners are fast"; Ho et al. NIPS 2013
§3 for SSP): at clock c, worker w computes its gradient on the weights after ``max(0, c - d_w)`` updates,
and the server applies the mean of the workers' gradients as clock c's AdamW step. Under SSP with bound s
and one worker slowed by a delay longer than a fast step, the fast workers read exactly s clocks stale
(their pull at clock c is answered the moment clock c - s - 1 completes) and the slow one reads the
newest weights, so that run *is* this computation with ``d = s`` for the fast workers and 0 for the slow
one -- which lets a test pin the server's aggregation to a deterministic reference, and a benchmark
separate what staleness costs the optimizer from what the timing of a run adds.

Everything else is the run's: model, initialisation, data shards (each worker's windows are the ones
data-parallel rank w of the same number of ranks reads), the learning-rate schedule, weight decay and
global-norm clipping of the mean gradient, as the servers apply them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.config import Config
from shardwise.data import DistributedWindowSampler, TokenWindows, prepare_corpus, val_indices
from shardwise.model import Transformer
from shardwise.parallel.grad_norm import clip_grad_norm, parameter_pieces
from shardwise.train.optim import build_optimizer, lr_at, set_lr


@dataclass
class DelayedResult:
    losses: list[float]
    """Per clock, the mean over workers of each worker's loss on its own (stale) weights."""
    val_loss: float | None
    state_dict: dict[str, torch.Tensor]


def train_delayed(cfg: Config, run_dir: Path, delays: list[int]) -> DelayedResult:
    """Train ``cfg`` for ``cfg.train.steps`` clocks in this process with ``len(delays)`` simulated workers,
    worker w reading the weights ``delays[w]`` clocks old. All delays 0 is synchronous data parallelism."""
    tcfg = cfg.train
    n = len(delays)
    corpus = prepare_corpus(cfg.data, Path(run_dir))
    windows = TokenWindows(corpus.train_path, cfg.data.seq_len)
    samplers = [DistributedWindowSampler(len(windows), tcfg.global_batch, tcfg.seed, w, n) for w in range(n)]
    torch.manual_seed(tcfg.seed)
    model = Transformer(cfg.model)
    model.reset_parameters(tcfg.seed)
    probe = Transformer(cfg.model)  # computes the gradients on an older copy of the weights
    optimizer = build_optimizer(model, tcfg)
    history = [_snapshot(model)]  # history[k]: the weights after k updates (only the last max(delays)+1 kept)
    first = 0  # the update count of history[0]
    losses = []
    for clock in range(tcfg.steps):
        grads: dict[str, torch.Tensor] = {}
        loss_sum = 0.0
        for w, delay in enumerate(delays):
            probe.load_state_dict(history[max(0, clock - delay) - first])
            probe.zero_grad(set_to_none=True)
            batches = [windows.batch(ids) for ids in samplers[w].micro_batches(clock, tcfg.micro_batch)]
            for x, y in batches:
                loss = probe(x, y)
                (loss / len(batches)).backward()
                loss_sum += float(loss.detach()) / len(batches)
            for name, p in probe.named_parameters():
                grads.setdefault(name, torch.zeros_like(p)).add_(p.grad)
        for name, p in model.named_parameters():
            p.grad = grads[name].div_(n)
        clip_grad_norm(parameter_pieces(model.parameters()), tcfg.grad_clip)
        set_lr(optimizer, lr_at(clock, tcfg))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / n)
        history.append(_snapshot(model))
        while len(history) > max(delays) + 1:
            history.pop(0)
            first += 1
    return DelayedResult(losses, _val_loss(model, TokenWindows(corpus.val_path, cfg.data.seq_len), tcfg, n),
                         {k: v.detach().clone() for k, v in model.state_dict().items()})


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def _val_loss(model, windows: TokenWindows, tcfg, n_workers: int) -> float | None:
    """The validation loss the parameter-server run reports: the held-out windows its n workers split."""
    model.eval()
    total = count = 0.0
    for w in range(n_workers):
        ids = val_indices(len(windows), tcfg.eval_batches * tcfg.global_batch, w, n_workers)
        for start in range(0, len(ids), tcfg.micro_batch):
            x, y = windows.batch(ids[start:start + tcfg.micro_batch])
            total += float(model(x, y)) * x.shape[0]
            count += x.shape[0]
    return total / count if count else None
