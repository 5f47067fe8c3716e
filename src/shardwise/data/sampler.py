"""Packing and sampling: fixed token windows over the cache, and which windows each data-parallel
rank reads at each optimizer step.

The promise of the package is that every parallel layout trains the same model. For the data this
means: the *global* batch of optimizer step ``s`` is the same set of windows whatever the number
of data-parallel ranks, and each rank reads one contiguous slice of it. Splitting a fixed global
batch evenly across ranks and averaging gradients gives the same update as one process reading the
whole batch (Goyal et al., 2017, "Accurate, Large Minibatch SGD", section 2; the same convention as
``torch.utils.data.DistributedSampler`` with ``drop_last``, but indexed by step rather than epoch).

Every method is a pure function of ``step``: epoch ``e`` is a fresh permutation of all windows drawn
from ``(seed, e)``, and step ``s`` takes the ``s % steps_per_epoch``-th run of ``global_batch``
windows from the permutation of epoch ``s // steps_per_epoch`` (the tail that does not fill a batch
is dropped). Resuming mid-epoch from a checkpoint is therefore just calling with the saved step;
:meth:`DistributedWindowSampler.state_dict` / :meth:`~DistributedWindowSampler.load_state_dict`
record it and check that the resumed run samples the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardwise.data.cache import read_meta
from shardwise.data.sources import DataError


class TokenWindows:
    """Fixed, non-overlapping windows over a token file, read through a read-only memory map.

    Window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: inputs are its first ``seq_len``
    tokens and targets the same shifted by one, so ``len = (n_tokens - 1) // seq_len``. Opening is
    cheap; the data is paged in as windows are read. Pickles by path (safe to send to workers).
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str | np.dtype | None = None):
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be positive")
        self.path, self.seq_len = Path(path), int(seq_len)
        self.dtype = np.dtype(dtype if dtype is not None else read_meta(self.path.parent)["dtype"])
        n = self.path.stat().st_size // self.dtype.itemsize
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(n,)) if n else np.zeros(0, self.dtype)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        start = (i % n) * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def batch(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``ids`` stacked: inputs and targets, int64 tensors of shape [len(ids), seq_len]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"window ids must be in [0, {len(self)}); got {ids.min()}..{ids.max()}")
        rows = self.tokens[ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)].astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __getstate__(self) -> dict:
        return {"path": self.path, "seq_len": self.seq_len, "dtype": self.dtype.str}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["seq_len"], state["dtype"])


class DistributedWindowSampler:
    """Global batches of window ids per optimizer step, and this rank's share of them.

    Args:
        num_windows: windows in the training data (``len(TokenWindows)``).
        global_batch: windows per optimizer step, over all data-parallel ranks.
        seed: seeds the per-epoch permutations (the same on every rank and layout).
        dp_rank, dp_size: this rank's position in the data-parallel group; ``dp_size`` must divide
            ``global_batch``.
    """

    def __init__(self, num_windows: int, global_batch: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if global_batch < 1:
            raise DataError(f"global_batch={global_batch} must be positive")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        if global_batch % dp_size:
            raise DataError(f"global_batch={global_batch} is not divisible by the data-parallel size {dp_size}")
        if num_windows < global_batch:
            raise DataError(
                f"the training corpus is too small for the batch: {num_windows} windows of the sequence length, "
                f"but train.global_batch={global_batch}; use a larger corpus (data.max_bytes, data.source), "
                "a shorter data.seq_len or a smaller train.global_batch"
            )
        self.num_windows, self.global_batch, self.seed = int(num_windows), int(global_batch), int(seed)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.per_rank = global_batch // dp_size
        self.steps_per_epoch = num_windows // global_batch
        self._cached: tuple[int, np.ndarray] | None = None

    def epoch_of(self, step: int) -> int:
        """The epoch (0-based pass over the windows) that optimizer step ``step`` belongs to."""
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of all windows in ``epoch``: a permutation drawn from ``(seed, epoch)``."""
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            self._cached = (epoch, rng.permutation(self.num_windows))
        return self._cached[1]

    def global_indices(self, step: int) -> list[int]:
        """The ``global_batch`` window ids of optimizer step ``step`` (0-based), identical for every layout."""
        if step < 0:
            raise DataError(f"step={step} must be >= 0")
        offset = (step % self.steps_per_epoch) * self.global_batch
        return self.permutation(self.epoch_of(step))[offset : offset + self.global_batch].tolist()

    def rank_indices(self, step: int) -> list[int]:
        """This rank's contiguous slice ``global_indices(step)[r*k:(r+1)*k]``, ``k = global_batch // dp_size``."""
        k, r = self.per_rank, self.dp_rank
        return self.global_indices(step)[r * k : (r + 1) * k]

    def micro_batches(self, step: int, micro_batch: int) -> list[list[int]]:
        """This rank's windows of ``step`` as consecutive chunks of ``micro_batch`` (gradient accumulation)."""
        if micro_batch < 1 or self.per_rank % micro_batch:
            raise DataError(f"micro_batch={micro_batch} does not divide the {self.per_rank} windows per rank "
                            f"(global_batch={self.global_batch} / dp={self.dp_size})")
        ids = self.rank_indices(step)
        return [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]

    def state_dict(self, step: int) -> dict:
        """What a checkpoint records to resume at optimizer step ``step`` (the next step to run)."""
        return {
            "step": int(step),
            "epoch": self.epoch_of(step),
            "offset": (step % self.steps_per_epoch) * self.global_batch,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict) -> int:
        """Check that a checkpoint's sampling matches this sampler and return the step to resume at.

        Raises DataError when seed, global batch or number of windows differ (the resumed run would
        read a different sequence of batches); the data-parallel size may differ freely.
        """
        for key in ("seed", "global_batch", "num_windows"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DataError(
                    f"cannot resume: the checkpoint's data sampling used {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; keep the seed, train.global_batch, corpus and data.seq_len of the run"
                )
        if "step" not in state or int(state["step"]) < 0:
            raise DataError(f"cannot resume: the sampler state has no valid step ({state!r})")
        return int(state["step"])


def val_indices(num_val_windows: int, total: int, dp_rank: int = 0, dp_size: int = 1) -> list[int]:
    """One data-parallel rank's share of a fixed validation set: the first ``total`` windows.

    The set does not depend on the layout (callers pass ``train.eval_batches * train.global_batch``), so
    every layout reports the validation loss of the same windows. Ranks take contiguous runs of
    ``total // dp_size``; when validation holds fewer windows, every rank gets
    ``num_val_windows // dp_size`` (possibly none: then every rank gets none, so ranks stay in step and
    a caller can skip evaluation).
    """
    if total < 0 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"val_indices: need total >= 0 and 0 <= dp_rank < dp_size; got total={total}, "
                        f"{dp_rank}, {dp_size}")
    per = min(total // dp_size, num_val_windows // dp_size)
    return list(range(dp_rank * per, (dp_rank + 1) * per))
