"""gloo's own collectives on 2 local processes, on one activation of bench/sim_validate.py's tensor-parallel runs.

    python bench/gloo_collectives.py

The simulator costs every gloo collective from a ring shift's alpha and beta (``dist/comm/cost.calibrate``);
this times gloo's native all-reduce, all-gather and reduce-scatter of a 16 x 128 x 256 fp32 tensor (2 MiB) and a
1 KiB all-reduce, one thread per process as the trainer's ranks, so the two can be held against each other.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.dist.mesh import free_port


def _rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.randn(16, 128, 256)
    calls = {"all-reduce 2 MiB": lambda: dist.all_reduce(x),
             "all-gather 2 MiB": lambda: dist.all_gather_single(torch.empty(32, 128, 256), x),
             "reduce-scatter 2 MiB": lambda: dist.reduce_scatter_single(torch.empty(8, 128, 256), x),
             "all-reduce 1 KiB": lambda: dist.all_reduce(torch.ones(256))}
    for name, call in calls.items():
        for _ in range(3):
            call()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        if rank == 0:
            print(f"{name:>22}: {(time.perf_counter() - t0) / 20 * 1e3:7.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(free_port(),), nprocs=2)
