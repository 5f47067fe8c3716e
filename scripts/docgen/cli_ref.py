"""docs/reference/cli.md: every command and option, from the argument parsers themselves.

``shardwise``'s subcommands come from ``shardwise.cli.build_parser``; ``plan`` and ``simulate`` parse their own
options (``shardwise.plan.cli.build_parser``, ``shardwise.sim.cli.build_parser``); ``bench comm`` builds its
parser inside its ``main``, so its ``add_argument`` calls are read from the source.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from docgen.markdown import GENERATED, table

OVERRIDES = ("train", "config", "plan", "simulate")
"""Subcommands that take config overrides (``--section.key VALUE``), as ``shardwise.cli.main`` allows."""


def _kind(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "flag"
    if action.choices:
        return " or ".join(f"`{c}`" for c in action.choices)
    if action.type is not None:
        name = getattr(action.type, "__name__", str(action.type))
        return TYPE_WORDS.get(name, name)
    return "text"


TYPE_WORDS = {"int": "integer", "float": "number", "str": "text", "Path": "path"}


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.default is None:
        return ""
    if action.default is argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def _nargs(action: argparse.Action) -> str:
    return {None: "", 0: "", "?": " (optional)", "*": " (any number)", "+": " (one or more)",
            argparse.REMAINDER: " (the rest)"}.get(action.nargs, f" ({action.nargs})")


def _sentence(text: str | None) -> str:
    text = (text or "").strip()
    return text[:1].upper() + text[1:] if text else ""


def parser_lines(parser: argparse.ArgumentParser, skip_help: bool = True) -> list[str]:
    """Usage line and an options table of one parser, built from its actions (not argparse's own usage text,
    which wraps to the terminal's width)."""
    positionals, options = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or (skip_help and isinstance(action, argparse._HelpAction)):
            continue
        if action.option_strings:
            options.append(action)
        else:
            positionals.append(action)
    usage = [parser.prog]
    for a in positionals:
        name = (a.metavar or a.dest).upper()
        usage.append(f"[{name}]" if a.nargs in ("?", "*") else f"{name} ..." if a.nargs == "+" else name)
    if options:
        usage.append("[options]")
    lines = ["```text", " ".join(usage), "```", ""]
    rows = [[f"`{(a.metavar or a.dest).upper()}`{_nargs(a)}", _kind(a) if a.choices else "", "", _sentence(a.help)]
            for a in positionals]
    rows += [[", ".join(f"`{s}`" for s in a.option_strings) + _nargs(a), _kind(a), _default(a),
              _sentence(a.help) + (" Required." if a.required else "")] for a in options]
    if rows:
        lines += table(["argument", "takes", "default", "what it does"], rows) + [""]
    return lines


def source_options(path: Path, function: str = "main") -> list[list[str]]:
    """Rows of the options table from the ``add_argument`` calls inside ``function`` of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    rows = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            kw = {k.arg: k.value for k in node.keywords}
            lit = {k: (v.value if isinstance(v, ast.Constant) else ast.unparse(v)) for k, v in kw.items()}
            takes = "flag" if lit.get("action") == "store_true" else f"one of `{lit['choices']}`" if "choices" in lit \
                else str(lit.get("type") or lit.get("metavar") or "text")
            nargs = {"?": " (optional)", "+": " (one or more)", "*": " (any number)"}.get(lit.get("nargs"), "")
            default = f"`{lit['default']}`" if "default" in lit else ""
            rows.append([", ".join(f"`{n}`" for n in names) + nargs, TYPE_WORDS.get(takes, takes), default,
                         _sentence(str(lit.get("help", "")))])
    return rows


def render(src: Path) -> str:
    from shardwise import cli
    from shardwise.plan import cli as plan_cli
    from shardwise.sim import cli as sim_cli
    from shardwise.train import __main__ as torchrun_entry

    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    lines = [
        "# Command-line reference",
        "",
        GENERATED.format(sources="the argument parsers (`shardwise.cli`, `shardwise.plan.cli`, "
                                 "`shardwise.sim.cli`, `shardwise.dist.comm.bench`)"),
        "",
        "`shardwise [--debug] COMMAND ...`. `--debug` (accepted anywhere on the line) shows tracebacks; without "
        "it bad input prints one line, `error: ...`, and exits 2. "
        + "Commands that take a config (" + ", ".join(f"`{c}`" for c in OVERRIDES) + ") also take any config "
        "field as `--section.key VALUE` (or `--section.key=VALUE`; a dotted flag with no value means `true`): "
        "see the [config reference](config.md). Every other command refuses them in one line.",
        "",
        "Commands: " + ", ".join(f"[`{name}`](#shardwise-{name})" for name in sub.choices) + ", and "
        "[`python -m shardwise.train`](#python--m-shardwisetrain) under torchrun.",
        "",
    ]
    delegated = {"plan": plan_cli.build_parser(), "simulate": sim_cli.build_parser()}
    for name, parser in sub.choices.items():
        lines += [f"## shardwise {name}", "", _sentence(helps.get(name)).rstrip(".") + ".", ""]
        if name in delegated:
            doc = (delegated[name].description or "").strip()
            lines += ([doc, ""] if doc else [])
            lines += parser_lines(delegated[name])
            if name == "plan":
                lines += ["Every option can also be given in the dotted form (`--plan.top 3`, "
                          "`--cluster.gpus_per_node 8`) or in a config file's `[plan]` / `[cluster]` tables.", ""]
            if name == "simulate":
                lines += ["`--sim.KEY VALUE` sets a field of the hardware file's `[sim]` table "
                          "(`shardwise.sim.hardware`).", ""]
        elif name == "bench":
            lines += ["```text", "shardwise bench comm [options]", "```", ""]
            lines += table(["argument", "takes", "default", "what it does"],
                           source_options(src / "shardwise" / "dist" / "comm" / "bench.py")) + [""]
        else:
            lines += parser_lines(parser)
    doc = (torchrun_entry.__doc__ or "").strip()
    lines += ["## python -m shardwise.train", "", " ".join(doc.split()), "",
              "```text", "torchrun [torchrun options] -m shardwise.train [CONFIG.toml] [--resume] "
              "[--section.key VALUE ...]", "```", ""]
    return "\n".join(lines).rstrip() + "\n"
