"""Collective algorithms vs the backend's native collectives: a thin wrapper of ``shardwise bench comm``.

    python bench/bench_comm.py --nproc 4 --sizes 4K,1M,16M,64M \\
        --json bench/results/comm_allreduce_4.json --plot bench/results/comm_allreduce_4.png

See ``shardwise.dist.comm.bench`` for what is measured (time, algbw, nccl-tests busbw,
cost-model prediction, ratio to native, and what "auto" picks).
"""

import sys

from shardwise.dist.comm.bench import main

if __name__ == "__main__":
    sys.exit(main())  # main(None): the command recorded is this script's, as invoked
