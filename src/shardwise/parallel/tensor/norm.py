"""An RMSNorm over a projection whose features are split over the tensor-parallel ranks.

OLMo 2 normalises the whole q and k projections (Team OLMo 2024, "2 OLMo 2 Furious", §3.1), not each head:
under tensor parallelism a rank holds only its heads' features, so the mean of squares must be summed over
the ranks (Zhang & Sennrich 2019, eq. 4, with the sum split). The statistic's all-reduce runs both ways: in
forward every rank needs the whole sum, and in backward the sum's gradient is the sum of every rank's use of
it. The gain is split like the projection's rows; each rank's piece gets its whole gradient.
"""

from __future__ import annotations

import torch

from shardwise.dist.comm.counting import CommStats
from shardwise.dist.functional import copy_to_region, reduce_from_region
from shardwise.model.layers import RMSNorm
from shardwise.parallel.tensor.layers import TPShard, _piece


class SplitRMSNorm(RMSNorm):
    """``norm``'s features ``rows`` on this rank; the statistic summed over ``group``."""

    def __init__(self, norm: RMSNorm, group, stats: CommStats | None, rows: tuple[int, int], axis: str = "tp"):
        super().__init__(norm.weight.shape[0], norm.eps, norm.unit_offset)
        self.group, self.stats, self.full_width = group, stats, norm.weight.shape[0]
        start, stop = rows
        self.weight = _piece(norm.weight, TPShard(axis, 0, tuple(norm.weight.shape), start, stop), stop - start)

    def statistic(self, x32: torch.Tensor) -> torch.Tensor:
        local = x32.pow(2).sum(-1, keepdim=True)
        return reduce_from_region(copy_to_region(local, self.group, self.stats), self.group, self.stats) / \
            self.full_width
