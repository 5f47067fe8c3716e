"""docs/reference/config.md: every config field, its type, default, choices, docstring and what refuses it.

The docstrings are read from ``config.py``'s syntax tree (a field's docstring is the string statement after
it); types and defaults from the dataclasses themselves; choices from ``config.CHOICES``; refusals from the
checks' source (:mod:`docgen.refusals`).
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from docgen.markdown import GENERATED, slug
from docgen.refusals import HOLE, Refusal, find_refusals


def field_docstrings(config_source: str) -> dict[str, dict[str, str]]:
    """``{ClassName: {attribute: docstring}}`` from the source of config.py."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(config_source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs: dict[str, str] = {}
        body = node.body
        for stmt, after in zip(body, body[1:] + [None], strict=True):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[stmt.target.id] = " ".join(after.value.value.split())
        out[node.name] = docs
    return out


def type_text(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in (args or [hint])]
    return " or ".join(names) + (" or unset" if type(None) in typing.get_args(hint) else "")


def value_text(value) -> str:
    if value is None:
        return "unset (derived)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def refusal_line(r: Refusal, choices: tuple | None) -> str:
    where = f"(`{r.where}`)"
    if r.kind == "positive":
        return f"- a value that is not a positive number {where}"
    if r.kind == "non-negative":
        return f"- a negative value {where}"
    if r.kind == "choice":
        options = r.text or (", ".join(f"`{c}`" for c in choices) if choices else "its choices")
        return f"- a value that is not one of {options} {where}"
    if r.kind == "unused":
        expr = ast.parse(r.condition, mode="eval").body
        negated = isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not)
        when = f"while `{ast.unparse(expr.operand)}`" if negated else f"unless `{r.condition}`"
        return f"- set away from its default {when}: «{r.field}={HOLE} {r.text}» {where}"
    return f"- «{r.text}» {where}"


def render(src: Path, config_source: str | None = None) -> str:
    """The page, from the package at ``src/shardwise`` (``config_source``: config.py's text, if not the file's)."""
    from shardwise import config as config_module

    package = src / "shardwise"
    docs = field_docstrings(config_source or (package / "config.py").read_text(encoding="utf-8"))
    tree = config_module.Config()
    sections = [(f.name, getattr(tree, f.name)) for f in dataclasses.fields(tree)]
    fields = {f"{name}.{config_module.key_name(f.name)}" for name, section in sections
              for f in dataclasses.fields(section)}
    refusals = find_refusals(package, fields)
    lines = [
        "# Config reference",
        "",
        GENERATED.format(sources="the config dataclasses (`src/shardwise/config.py`: types, defaults, docstrings, "
                                 "`CHOICES`) and the checks that refuse values (every `checks.py`, "
                                 "`config_resolve.py`, the launcher)"),
        "",
        "Every field can be set in a TOML file (`[parallel]` / `zero = 3`) or on the command line by its dotted "
        "name (`--parallel.zero 3`), with the same values; `none` unsets a field that may be unset. "
        "`shardwise config show [CONFIG.toml] [--section.key VALUE ...]` prints the resolved tree. A value of the "
        "wrong type is refused for every field in one line (`config.py`), before anything else is checked.",
        "",
        "Under each field, **refused** lists what stops `shardwise train` (and `plan`, `simulate`, `config show`) "
        "before any worker starts, each in one line that names the field. The lines are read from the source of "
        "the checks: a message as written there, with `…` for each value it interpolates; a value test "
        "(`positive`, `choice`); or an *unused-field* rule: a field set away from its default where the resolved "
        "layout would not read it. A check that names the field only in the middle of its message is listed "
        "under the field it names first.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{slug(name)})" for name, _ in sections) + ".",
        "",
    ]
    for name, section in sections:
        cls = type(section)
        lines += [f"## {name}", ""]
        summary = (cls.__doc__ or "").strip()
        if summary and not summary.startswith(f"{cls.__name__}("):
            lines += [" ".join(summary.split()), ""]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(section):
            dotted = f"{name}.{config_module.key_name(f.name)}"
            choices = config_module.CHOICES.get(dotted)
            lines += [f"### `{dotted}`", ""]
            facts = f"{type_text(hints[f.name])}; default {value_text(getattr(section, f.name))}"
            if choices:
                facts += "; one of " + ", ".join(value_text(c) for c in choices)
            lines += [facts + ".", "", docs.get(cls.__name__, {}).get(f.name, "(no docstring)"), ""]
            found = refusals.get(dotted, [])
            if found:
                lines += ["Refused:", ""] + [refusal_line(r, choices) for r in found] + [""]
            else:
                lines += ["Refused: no check names this field; any value of its type is taken.", ""]
    return "\n".join(lines).rstrip() + "\n"
