"""Regenerate the docs that come from the code and the results: ``python scripts/gen_docs.py [--check]``.

Writes docs/reference/config.md (the config dataclasses and the checks that refuse values),
docs/reference/cli.md (the argument parsers) and docs/benchmarks.md (bench/results/*.json). The output
depends on those sources only (no date, stable order), so running it twice changes nothing. ``--check``
writes nothing, lists the pages that differ from what it would write and exits 1 if any does
(tests/test_docs.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's package, whatever else is installed
if str(ROOT / "scripts") not in sys.path:
    sys.path.append(str(ROOT / "scripts"))

from docgen import bench_page, cli_ref, config_ref  # noqa: E402

PAGES: dict[str, Callable[[Path], str]] = {
    "docs/reference/config.md": lambda root: config_ref.render(root / "src"),
    "docs/reference/cli.md": lambda root: cli_ref.render(root / "src"),
    "docs/benchmarks.md": bench_page.render,
}
"""Each generated page (relative to the repository root) and the function that writes its text."""


def generate(root: Path = ROOT) -> dict[str, str]:
    """``{page: text}`` for every generated page."""
    return {page: render(root) for page, render in PAGES.items()}


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose committed text differs from what :func:`generate` writes (missing ones too)."""
    out = []
    for page, text in generate(root).items():
        path = root / page
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(page)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gen_docs.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    if args.check:
        pages = stale()
        for page in pages:
            print(f"{page} is out of date: run python scripts/gen_docs.py", file=sys.stderr)
        return 1 if pages else 0
    for page, text in generate().items():
        path = ROOT / page
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
