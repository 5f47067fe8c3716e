"""The command blocks of README.md and docs/: how they are marked, read, checked and shrunk to run.

Every fenced ``bash`` block carries a marker on the line before it, an HTML comment that the page does not show:

* ``<!-- run -->``: every command in it runs in tests/test_docs.py, on tiny overrides (``tiny_train`` there);
* ``<!-- check -->``: every ``shardwise train`` command is resolved as the trainer resolves it before starting
  workers (the config, the layout against its world size), not trained -- for layouts of 8 ranks, real sizes, or
  injected faults (which need the launcher's restarts);
* ``<!-- gpu-only -->``, ``<!-- multi-node -->``, ``<!-- long -->`` (a benchmark, a whole default run),
  ``<!-- synopsis -->`` (usage with placeholders), ``<!-- setup -->`` (installing): not run.

Whatever the marker, every command's options are checked against the code that parses them
(:func:`flag_problems`): ``shardwise`` subcommands against their argument parsers and the config tree, scripts
(``python bench/x.py``, ``torchrun examples/x.py``) against the ``add_argument`` calls in their source. So a flag
renamed in the docs, or in the code, fails a test even in a block that is not run.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKERS = ("run", "check", "gpu-only", "multi-node", "long", "synopsis", "setup")
MARKER_RE = re.compile(r"^<!--\s*([a-z-]+)(?::[^>]*)?\s*-->\s*$")
PREFIXES = ("sudo", "srun", "exec", "time")
"""Words before a command that run it (``sudo python ...``); ``ip netns exec NAME`` too."""


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    marker: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a page, each with the marker on the line before its fence (if any)."""
    out, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].lstrip().startswith("```"):
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER_RE.match(lines[k].strip()) if k >= 0 else None
        out.append(Block(path, start + 1, lang, marker.group(1) if marker else None, "\n".join(lines[start + 1:j])))
        i = j + 1
    return out


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block as token lists: continuations joined, comments dropped, ``&&`` / ``;``
    split, ``for V in a b; do ...; done`` expanded, runners (``sudo``, ``ip netns exec N``) dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    joined = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", joined)  # $(command) is a value, not options
    tokens: list[str] = []
    for line in joined.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&")
        lex.whitespace_split, lex.commenters = True, "#"
        tokens += [*lex, ";"]
    return [c for c in (_strip_runner(c) for c in _expand(_split(tokens))) if c]


def _split(tokens: list[str]) -> list[list[str]]:
    out, cur = [], []
    for t in tokens:
        if t in (";", "&&", "&"):
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out + ([cur] if cur else [])


def _expand(cmds: list[list[str]]) -> list[list[str]]:
    out, i = [], 0
    while i < len(cmds):
        c = cmds[i]
        if c[0] == "for" and len(c) >= 3 and c[2] == "in":
            var, values = c[1], c[3:]
            j = i + 1
            body = []
            while j < len(cmds) and cmds[j] != ["done"]:
                body.append(cmds[j][1:] if cmds[j][0] == "do" else cmds[j])
                j += 1
            for v in values:
                out += [[t.replace(f"${var}", v).replace(f"${{{var}}}", v) for t in b] for b in body]
            i = j + 1
        else:
            out.append(c)
            i += 1
    return out


def _strip_runner(c: list[str]) -> list[str]:
    while c and (c[0] in PREFIXES or re.match(r"^[A-Z_]+=", c[0])):
        c = c[1:]
    if c[:3] == ["ip", "netns", "exec"]:
        c = c[4:]
    return c


# ---- what a command runs, and whether its options exist --------------------------------------------------


def program(c: list[str]) -> tuple[str, list[str]]:
    """``("shardwise", args)``, ``("shardwise.train", args)`` (torchrun -m), ``("script:PATH", args)``,
    ``("pytest", args)`` or ``("other", c)``."""
    if c[0] == "shardwise":
        return "shardwise", c[1:]
    if c[0] in ("python", "python3"):
        if c[1:3] == ["-m", "pytest"]:
            return "pytest", c[3:]
        if c[1:3] == ["-m", "shardwise.cli"]:
            return "shardwise", c[3:]
        if len(c) > 1 and c[1].endswith(".py"):
            return f"script:{c[1]}", c[2:]
    if c[0] == "torchrun":
        for i, t in enumerate(c):
            if t == "-m" and i + 1 < len(c):
                return (c[i + 1] if c[i + 1] == "shardwise.train" else "other"), c[i + 2:]
            if t.endswith(".py"):
                return f"script:{t}", c[i + 1:]
    if c[0].endswith((".py", ".sh")):
        return f"script:{c[0]}", c[1:]
    return "other", c


@cache
def script_options(path: str) -> frozenset[str] | None:
    """The option strings a script's ``add_argument`` calls declare (its own file and ``bench/`` modules it
    imports), or None when it delegates to ``shardwise.dist.comm.bench``."""
    file = ROOT / path
    tree = ast.parse(file.read_text(encoding="utf-8"))
    opts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            opts |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
        if isinstance(node, ast.ImportFrom) and node.module == "shardwise.dist.comm.bench":
            return comm_bench_options()
        if isinstance(node, ast.ImportFrom) and node.module and (ROOT / "bench" / f"{node.module}.py").is_file():
            opts |= script_options(f"bench/{node.module}.py") or set()
    return frozenset(opts | {"-h", "--help"})


@cache
def comm_bench_options() -> frozenset[str]:
    return script_options("src/shardwise/dist/comm/bench.py")


def _parser_options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


PLACEHOLDER = re.compile(r"[A-Z]{2,}|section\.key")


def _config_key_problem(key: str) -> str | None:
    from shardwise.config import Config, ConfigError

    try:
        Config()._hint(key)
    except ConfigError as e:
        return str(e)
    return None


def flag_problems(c: list[str]) -> list[str]:
    """Why a command's options would be refused by what parses them ([] if they all exist)."""
    import argparse

    from shardwise.cli import build_parser, split_overrides

    prog, args = program(c)
    args = [a.strip("[]{}|,") for a in args if a.strip("[]{}|,")]
    problems = []
    if prog == "pytest":
        return [f"{a} does not exist" for a in args
                if a.startswith("tests/") and not (ROOT / a.split("::")[0]).exists()]
    if prog.startswith("script:"):
        path = prog.partition(":")[2]
        if not (ROOT / path).is_file():
            return [f"{path} does not exist"]
        if not path.endswith(".py"):
            return []
        known = script_options(path)
        return [f"{path} has no option {a}" for a in args if a.startswith("--") and a.split("=")[0] not in known]
    if prog not in ("shardwise", "shardwise.train"):
        return []
    rest, overrides = split_overrides(args)
    sub = "train" if prog == "shardwise.train" else (rest[0] if rest else "")
    rest = rest if prog == "shardwise.train" else rest[1:]
    top = build_parser()
    subparsers = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    if sub not in subparsers:
        return [f"shardwise has no command {sub!r}"]
    if sub == "plan":
        from shardwise.plan.cli import build_parser as plan_parser

        known = _parser_options(plan_parser())
    elif sub == "simulate":
        from shardwise.sim.cli import build_parser as sim_parser

        known = _parser_options(sim_parser())
    elif sub == "bench":
        known = set(comm_bench_options())
        rest = rest[1:]
    else:
        known = _parser_options(subparsers[sub]) | {"--debug"}
    for key in overrides:
        if PLACEHOLDER.search(key):
            continue
        section = key.partition(".")[0]
        if sub not in ("train", "config", "plan", "simulate"):
            problems.append(f"shardwise {sub} takes no config override --{key}")
        elif sub == "plan" and section in ("plan", "cluster"):
            flag = "--" + key.partition(".")[2].replace("_", "-")
            if flag not in known:
                problems.append(f"shardwise plan has no option --{key} ({flag})")
        elif sub == "simulate" and section == "sim":
            from shardwise.sim.hardware import FIELDS

            if key.partition(".")[2] not in FIELDS:
                problems.append(f"shardwise simulate: --{key} is not a field of [sim]")
        elif (problem := _config_key_problem(key)) is not None:
            problems.append(f"shardwise {sub}: {problem}")
    problems += [f"shardwise {sub} has no option {a}" for a in rest
                 if a.startswith("-") and not PLACEHOLDER.fullmatch(a.lstrip("-")) and a.split("=")[0] not in known]
    return problems
