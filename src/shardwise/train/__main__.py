"""``torchrun ... -m shardwise.train [CONFIG.toml] [--section.key VALUE ...]``: one worker of a run.

torchrun (several machines, or one) starts this on every rank; each rank validates the config
against the real world size, rank 0 prepares the data and writes the resolved config, and all
ranks train. ``run.dir`` should be set (or every node derives runs/torchrun-<rdzv id>).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from shardwise.cli import split_overrides
    from shardwise.config import Config, ConfigError
    from shardwise.config_resolve import resolve
    from shardwise.worker import train

    rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    if "--resume" in rest:
        rest.remove("--resume")
        overrides["ckpt.resume"] = "true"
    if len(rest) > 1:
        print(f"error: unexpected arguments {rest[1:]}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = Config.load(rest[0] if rest else None, overrides)
        cfg.parallel.nproc = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cfg.parallel.nnodes = max(1, world // cfg.parallel.nproc)
        if not cfg.run.dir:
            cfg.run.dir = f"runs/torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
        if int(os.environ.get("RANK", "0")) == 0:
            from shardwise.launch import prepare_run

            resolved, run_dir = prepare_run(cfg, world_size=world)
        else:
            from shardwise.data import prepare_corpus

            run_dir = Path(cfg.run.dir)
            checked = resolve(cfg, world_size=world)
            resolved = resolve(cfg, world_size=world, tokenizer_vocab=prepare_corpus(checked.data, None).vocab_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from shardwise.dist.diagnose import diagnosed, run_dir_recorder

    diagnosed(lambda: train(resolved, run_dir), run_dir_recorder(run_dir))  # names a failed collective
    from shardwise.dist.mesh import shutdown_distributed

    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
