"""The package's modules import each other without a ring: each room can be read (and changed) from its own
imports down. Every import counts -- top-level and inside functions, and a package's names loaded on first use
(its ``_EXPORTS`` table, :mod:`shardwise.lazy`) -- except those under ``if TYPE_CHECKING``, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

PACKAGE = Path(shardwise.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports: ``from a.b import c`` names ``a.b.c`` when that is a module,
    else ``a.b``; a relative import resolves against the module's package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            targets = [ast.literal_eval(v) for v in node.value.values]  # the lazy namespace's modules
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import ring as ``[a, b, ..., a]``, or None (depth-first search, colouring the path)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (ring := visit(nxt)):
                return ring
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (ring := visit(start)):
            return ring
    return None


def test_no_import_ring_in_the_package():
    graph = import_graph()
    assert len(graph) > 100 and "shardwise.train.engine" in graph
    ring = find_cycle(graph)
    assert ring is None, "import ring: " + " -> ".join(ring)


def test_the_walk_sees_imports_inside_functions_and_finds_a_ring():
    """The detector itself: a function-level import that closes a ring is found, a TYPE_CHECKING one is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = PACKAGE / "worker.py"  # imports the ps runner and the loop inside its function
    found = imports_of(source, set(import_graph()))
    assert {"shardwise.ps.runner", "shardwise.train.loop"} <= found
    consolidate = PACKAGE / "parallel" / "zero" / "consolidate.py"  # its wrapper import is for type checking only
    assert "shardwise.parallel.zero.wrapper" not in imports_of(consolidate, set(import_graph()))
    lazy = PACKAGE / "parallel" / "zero" / "__init__.py"  # names loaded on first use still count
    assert "shardwise.parallel.zero.wrapper" in imports_of(lazy, set(import_graph()))


def test_config_checks_load_without_the_heavy_modules():
    """The config tree imports nothing of the package but the preset names; each technique's checks only the
    tree and the shared helpers (the rules are functions of the config alone)."""
    graph = import_graph()
    assert graph["shardwise.config"] == {"shardwise.model.presets"}
    light = {"shardwise.config", "shardwise.checks", "shardwise.train.faults", "shardwise.model.presets"}
    for name in ("parallel.tensor.checks", "parallel.context.checks", "parallel.pipeline.checks",
                 "parallel.expert.checks", "parallel.zero.checks", "ps.checks", "dist.comm.checks", "dist.checks",
                 "train.checks"):
        assert graph[f"shardwise.{name}"] <= light, (name, graph[f"shardwise.{name}"] - light)


def test_resolving_a_config_does_not_import_torch():
    """``shardwise config show`` and a bad field's one-line error stay fast: resolving the default config loads
    each technique's checks without their packages' torch code (run.device "cpu": "auto" asks torch for GPUs)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from shardwise.config import Config; from shardwise.config_resolve import resolve; "
            "cfg = Config(); cfg.run.device = 'cpu'; resolve(cfg, tokenizer_vocab=257); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.stdout.strip() == "False"


def test_no_lazy_name_is_shadowed_by_a_submodule():
    """Importing submodule ``pkg.x`` sets the attribute ``pkg.x`` to the module, so a name loaded on first use
    must not be a submodule's name too (``from shardwise.parallel.pipeline import partition`` would then give
    the module once anything had imported ``shardwise.parallel.pipeline.partition``)."""
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                names = {ast.literal_eval(k) for k in node.value.keys}
                submodules = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir()
                                                                           if (p / "__init__.py").exists()}
                assert not names & submodules, (str(init), names & submodules)
