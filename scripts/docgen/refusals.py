"""What refuses each config field, read from the source of the checks (not executed).

A field is refused in three ways, all found here by walking the syntax trees of the modules that check a
config before any worker starts:

* a ``ConfigError`` (or, in a ``checks.py``, a ``ValueError`` its caller turns into one) whose message
  begins by naming the field: the message is kept as its template, every interpolated value shown as ``…``;
* the shared value tests of :mod:`shardwise.checks`, ``positive("field", ...)`` and ``choice("field", ...)``;
* an ``Unused(field, read, why)`` rule: the field, set away from its default while ``read`` is false, is
  refused with ``why``; ``read`` is shown as source, its local names (``p``, ``m``, ...) written as the
  config sections they stand for.

Names bound by ``for`` loops and comprehensions over literal tuples (or module-level tuples) are expanded,
so ``positive(f"parallel.{axis}", ...)`` inside ``for axis in ("tp", "pp")`` counts for both fields. A message
whose field is computed any other way is not attributed to a field (it is left out, not guessed).
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

SECTION_OF_TYPE = {"ModelConfig": "model", "DataConfig": "data", "TrainConfig": "train",
                   "ParallelConfig": "parallel", "CommConfig": "comm", "PsConfig": "ps", "CkptConfig": "ckpt",
                   "RunConfig": "run", "Config": "cfg"}
"""A parameter annotated with one of these types stands for that config section (``cfg``: the whole tree)."""

OUTSIDE = ("plan/", "sim/", "cli.py", "config.py")
"""Modules not scanned: the planner's and the simulator's own checks (of their own flags), the command line's
(of ``generate``'s flags), and the tree's type conversion (the same for every field; described once)."""

HOLE = "…"
"""How an interpolated value of a message template is shown."""


@dataclass(frozen=True, order=True)
class Refusal:
    field: str
    kind: str
    """"error" (a check's message), "positive", "non-negative", "choice" or "unused"."""
    text: str
    """The message template (error, unused), or the options (choice with its own options)."""
    where: str
    """``module/path.py: function`` of the check."""
    condition: str = ""
    """For "unused": the expression under which the field is read."""


def scanned_modules(package: Path) -> list[Path]:
    """Every module of the package that may refuse a config value, in a stable order."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith(OUTSIDE) or rel in OUTSIDE:
            continue
        text = path.read_text(encoding="utf-8")
        if "ConfigError" in text or "Unused(" in text or path.name == "checks.py":
            out.append(path)
    return out


def find_refusals(package: Path, fields: set[str]) -> dict[str, list[Refusal]]:
    """``{dotted field: [Refusal, ...]}`` for every field of ``fields`` some check names."""
    found: dict[str, set[Refusal]] = {}
    for path in scanned_modules(package):
        rel = path.relative_to(package).as_posix()
        scanner = _Scanner(rel, ast.parse(path.read_text(encoding="utf-8")), fields)
        for refusal in scanner.refusals:
            found.setdefault(refusal.field, set()).add(refusal)
    return {f: sorted(rs) for f, rs in found.items()}


FIELD_RE = re.compile(r"\b([a-z]+)\.([a-z_][a-z0-9_]*)")


def first_field(message: str, fields: set[str]) -> str | None:
    """The config field a message names first (``parallel.dp*tp*pp*cp=4 ...`` names ``parallel.dp``)."""
    for m in FIELD_RE.finditer(message):
        dotted = f"{m.group(1)}.{m.group(2)}"
        if dotted in fields:
            return dotted
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, module: str, tree: ast.Module, fields: set[str]):
        self.module, self.fields = module, fields
        self.refusals: list[Refusal] = []
        self.constants = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                          for t in n.targets if isinstance(t, ast.Name)}
        self.function = "<module>"
        self.aliases: dict[str, str] = {}
        self.locals: dict[str, ast.expr] = {}
        self.bindings: dict[str, list[str]] = {}
        self.is_checks = module.endswith("checks.py")
        self.visit(tree)

    # ---- context ------------------------------------------------------------------------------------------

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved = self.function, self.aliases, self.locals
        self.function = node.name
        self.aliases = {}
        for arg in node.args.args:
            ann = arg.annotation
            name = ann.id if isinstance(ann, ast.Name) else ann.value if isinstance(ann, ast.Constant) else None
            if name in SECTION_OF_TYPE:
                self.aliases[arg.arg] = SECTION_OF_TYPE[name]
        self.locals = {}
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                self._bind(stmt.targets[0], stmt.value)
        self.generic_visit(node)
        self.function, self.aliases, self.locals = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind(t, v)
        elif isinstance(target, ast.Name):
            section = self._section(value)
            if section:
                self.aliases[target.id] = section
            else:
                self.locals[target.id] = value

    def _section(self, node: ast.expr) -> str | None:
        """``cfg.parallel`` -> "parallel" (an alias of a config section)."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg":
            return node.attr
        return None

    def visit_For(self, node: ast.For) -> None:
        values = self._literal_strings(node.iter)
        if isinstance(node.target, ast.Name) and values is not None:
            saved = self.bindings.get(node.target.id)
            self.bindings[node.target.id] = values
            self.generic_visit(node)
            if saved is None:
                del self.bindings[node.target.id]
            else:
                self.bindings[node.target.id] = saved
        else:
            self.generic_visit(node)

    def visit_ListComp(self, node: ast.ListComp) -> None:
        added = []
        for gen in node.generators:
            values = self._literal_strings(gen.iter)
            if isinstance(gen.target, ast.Name) and values is not None:
                self.bindings[gen.target.id] = values
                added.append(gen.target.id)
        self.generic_visit(node)
        for name in added:
            del self.bindings[name]

    def _literal_strings(self, node: ast.expr) -> list[str] | None:
        if isinstance(node, ast.Name) and node.id in self.constants:
            node = self.constants[node.id]
        if isinstance(node, (ast.Tuple, ast.List)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            return [e.value for e in node.elts]
        return None

    # ---- rendering ----------------------------------------------------------------------------------------

    def texts(self, node: ast.expr, depth: int = 0) -> list[str]:
        """Every text ``node`` can be, loop names expanded, other interpolations shown as ``…``; [] if unknown."""
        if depth > 4:
            return []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Name) and node.id in self.locals:
            return self.texts(self.locals[node.id], depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return [a + b for a, b in itertools.product(self.texts(node.left, depth + 1),
                                                         self.texts(node.right, depth + 1))]
        if isinstance(node, ast.JoinedStr):
            parts: list[list[str]] = []
            for value in node.values:
                if isinstance(value, ast.Constant):
                    parts.append([str(value.value)])
                elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) \
                        and value.value.id in self.bindings:
                    parts.append(self.bindings[value.value.id])
                else:
                    parts.append([HOLE])
            return ["".join(p) for p in itertools.product(*parts)]
        return []

    def source(self, node: ast.expr) -> str:
        """``node`` as source, with section aliases written as their sections (``p.zero`` -> ``parallel.zero``)."""
        aliases, local_exprs = self.aliases, {k: v for k, v in self.locals.items() if not self.texts(v)}

        class Rename(ast.NodeTransformer):
            def visit_Attribute(self, n: ast.Attribute) -> ast.AST:
                if isinstance(n.value, ast.Name) and n.value.id == "cfg":
                    return ast.Name(id=n.attr, ctx=n.ctx)
                return self.generic_visit(n)

            def visit_Name(self, n: ast.Name) -> ast.AST:
                if n.id in local_exprs:  # a local condition (``on = p.pp > 1``) is shown as what it computes
                    return self.visit(ast.parse(ast.unparse(local_exprs[n.id]), mode="eval").body)
                return ast.Name(id=aliases.get(n.id, n.id), ctx=n.ctx)

        return ast.unparse(Rename().visit(ast.parse(ast.unparse(node), mode="eval")))

    # ---- what refuses -------------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr \
            if isinstance(node.func, ast.Attribute) else ""
        where = f"{self.module}: {self.function}"
        if name == "ConfigError" or (name == "ValueError" and self.is_checks):
            for text in self.texts(node.args[0]) if node.args else []:
                field = first_field(text, self.fields)
                if field:
                    self.refusals.append(Refusal(field, "error", " ".join(text.split()), where))
        elif name in ("positive", "choice") and node.args:
            for text in self.texts(node.args[0]):
                if text in self.fields:
                    self.refusals.append(self._value_test(name, text, node, where))
        elif name == "Unused" and len(node.args) == 3:
            whys = self.texts(node.args[2]) or [HOLE]
            for field in self.texts(node.args[0]):
                if field in self.fields:
                    for why in whys:
                        self.refusals.append(Refusal(field, "unused", " ".join(why.split()), where,
                                                     self.source(node.args[1])))
        self.generic_visit(node)

    def _value_test(self, name: str, field: str, node: ast.Call, where: str) -> Refusal:
        if name == "positive":
            zero = any(k.arg == "allow_zero" and isinstance(k.value, ast.Constant) and k.value.value
                       for k in node.keywords)
            return Refusal(field, "non-negative" if zero else "positive", "", where)
        options = node.args[2] if len(node.args) > 2 else None
        return Refusal(field, "choice", self.source(options) if options is not None else "", where)
