"""The ``shardwise`` command: train, generate, export, plot, config show.

Any config field can be given as ``--section.key VALUE`` after the subcommand's own options.
Errors from bad input print one line and exit 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separate ``--section.key VALUE`` / ``--section.key=VALUE`` pairs from the other arguments.

    A dotted flag with no value (followed by another flag or nothing) means ``true``."""
    rest, overrides = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    value = argv[i + 1]
                    i += 1
                else:
                    value = "true"
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


PASS_THROUGH = ("plan", "bench", "simulate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (default: a small GPT on the Python standard library)")
    p.add_argument("config", nargs="?", help="TOML config file")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("run_dir", type=Path, help="a run directory (e.g. runs/latest)")
    p.add_argument("--prompt", action="append", help="text to continue (repeat for a batch; default 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample after each prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (1 = greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint directory (default: the newest valid one)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every step (no key/value "
                                                           "cache; the same tokens, slower)")

    p = sub.add_parser("export", help="write a run's model and tokenizer for another library (--format hf: "
                                      "a transformers directory)")
    p.add_argument("run_dir", type=Path, help="a run directory (its newest valid checkpoint is exported)")
    p.add_argument("out_dir", type=Path, help="the directory to write (new, or empty)")
    p.add_argument("--format", choices=["hf"], required=True, help="hf: config.json, model.safetensors (or shards "
                                                                   "and their index), tokenizer")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint directory (default: the newest valid one)")
    p.add_argument("--dtype", help="bf16, fp16 or fp32 (default: the run's parameter dtype, bf16 for bf16 runs)")
    p.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 5GB (default), 500MB, 2GiB")

    p = sub.add_parser("plot", help="plot loss and throughput of runs; `plot timeline RUN_DIR`: a pipeline's schedule")
    p.add_argument("run_dirs", nargs="+", type=Path, help="run directories to plot together, or `timeline RUN_DIR`")
    p.add_argument("--out", type=Path, help="PNG file (default: RUN_DIR/plot.png of the first run, "
                                            "or RUN_DIR/timeline.png and RUN_DIR/timeline.trace.json)")

    p = sub.add_parser("plan", help="predict memory, FLOPs, communication and time; search layouts", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("simulate", help="simulate a training step on a modelled cluster, from the engine's own "
                                        "schedules", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("bench", help="benchmarks, e.g. `shardwise bench comm`", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("config", help="show the resolved config")
    p.add_argument("action", choices=["show"])
    p.add_argument("config", nargs="?", help="TOML config file")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides = split_overrides(argv)
    debug = "--debug" in rest  # accepted anywhere on the line, not only before the subcommand
    rest = [a for a in rest if a != "--debug"]
    if rest and rest[0] in PASS_THROUGH:  # these parse their own options (argparse REMAINDER rejects a leading flag)
        args = argparse.Namespace(command=rest[0], args=rest[1:])
    else:
        args = build_parser().parse_args(rest)
    args.debug = debug
    if overrides and args.command not in ("train", "config", "plan", "simulate"):
        print(f"error: config overrides are not accepted by `shardwise {args.command}`", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](args, overrides)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit codes
        return _report(e, args.debug)


def _report(error: Exception, debug: bool) -> int:
    from shardwise.launch import Interrupted, WorkerFailed

    if isinstance(error, Interrupted):  # not an error: where the run stood and the command that continues it
        print(error, file=sys.stderr)
        return error.exit_code
    if debug:
        traceback.print_exc()
        if isinstance(error, WorkerFailed) and error.traceback_text:
            print(error.traceback_text, file=sys.stderr)
    known = _known_errors()
    if isinstance(error, known):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not debug:
        print(f"error: {type(error).__name__}: {error} (run with --debug for the traceback)", file=sys.stderr)
    return 1


def _known_errors() -> tuple[type[BaseException], ...]:
    from shardwise.data import DataError
    from shardwise.hf.config_map import HFError
    from shardwise.launch import WorkerFailed
    from shardwise.train.checkpoint import CheckpointError

    return (ConfigError, DataError, CheckpointError, WorkerFailed, FileNotFoundError, FileExistsError, HFError)


def cmd_train(args, overrides: dict[str, str]) -> int:
    from shardwise.launch import launch

    if args.resume:
        overrides["ckpt.resume"] = "true"
    cfg = Config.load(args.config, overrides)
    run_dir = launch(cfg, debug=args.debug)
    print(f"run directory: {run_dir}")
    return 0


def check_generate_flags(args) -> None:
    """ConfigError naming the flag when a value of ``shardwise generate`` cannot be sampled with."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: give at least 1 (1 = greedy; the vocabulary size = no cut)")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature {args.temperature}: give 0 (greedy) or more")
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise ConfigError('--prompt "": every prompt needs at least one character to continue')


def cmd_generate(args, _overrides) -> int:
    from shardwise.generate_run import generate_from_run

    check_generate_flags(args)
    prompts = args.prompt or ["def "]
    timing: dict = {}
    texts = generate_from_run(args.run_dir, prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                              args.checkpoint, use_cache=not args.no_cache, timing=timing)
    for prompt, text in zip(prompts, texts, strict=True):
        print(prompt + text)
    how = "no cache" if args.no_cache else "key/value cache"
    print(f"{timing['tokens']} tokens in {timing['seconds']:.2f} s: {timing['tokens_per_s']:.1f} tokens/s "
          f"({len(prompts)} prompt(s), {how})", file=sys.stderr)
    return 0


def cmd_export(args, _overrides) -> int:
    from shardwise.hf.export import export_run
    from shardwise.run_dir import check_path

    check_path(args.out_dir, "OUT_DIR")
    out = export_run(args.run_dir, args.out_dir, args.checkpoint, args.dtype, args.max_shard_size)
    weights = sorted(p.name for p in out.glob("model*.safetensors"))
    what = weights[0] if len(weights) == 1 else f"{len(weights)} weight shards and their index"
    print(f"wrote {out} (config.json, {what}, tokenizer); load it with transformers' "
          "AutoModelForCausalLM.from_pretrained")
    return 0


def cmd_plot(args, _overrides) -> int:
    from shardwise.plot import plot_runs, plot_timeline

    first = args.run_dirs[0]
    if str(first) == "timeline" and not (first / "metrics.jsonl").exists():
        if len(args.run_dirs) != 2:
            print("usage: shardwise plot timeline RUN_DIR [--out PNG]", file=sys.stderr)
            return 2
        png, trace = plot_timeline(args.run_dirs[1], args.out)
        print(f"wrote {png} and {trace} (open in chrome://tracing or ui.perfetto.dev)")
        return 0
    out = args.out or (args.run_dirs[0] / "plot.png")
    path = plot_runs(list(args.run_dirs), out)
    print(f"wrote {path}")
    return 0


def cmd_config(args, overrides: dict[str, str]) -> int:
    cfg = Config.load(args.config, overrides)
    print(resolve(cfg).to_toml(), end="")
    return 0


def cmd_plan(args, overrides: dict[str, str]) -> int:
    """Delegates to shardwise.plan.cli.main(argv, overrides) -> exit code."""
    from shardwise.plan.cli import main as plan_main

    return plan_main(args.args, overrides)


def cmd_simulate(args, overrides: dict[str, str]) -> int:
    """Delegates to shardwise.sim.cli.main(argv, overrides) -> exit code."""
    from shardwise.sim.cli import main as simulate_main

    return simulate_main(args.args, overrides)


def cmd_bench(args, _overrides) -> int:
    """``shardwise bench comm ...`` delegates to shardwise.dist.comm.bench.main(argv) -> exit code."""
    benches = {"comm": "shardwise.dist.comm.bench"}
    if not args.args or args.args[0] not in benches:
        print(f"usage: shardwise bench {{{','.join(benches)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(benches[args.args[0]]).main(args.args[1:])


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "export": cmd_export, "plot": cmd_plot, "config": cmd_config,
            "plan": cmd_plan, "simulate": cmd_simulate, "bench": cmd_bench}

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
