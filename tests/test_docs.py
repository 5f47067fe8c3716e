"""The documentation cannot drift: generated pages are current, links resolve, and the commands run.

* The pages ``scripts/gen_docs.py`` writes (the config and command-line references, the benchmark page) equal
  what it writes now, and a docstring changed in config.py changes the reference it writes.
* Every relative link and image of README.md and docs/ points at a file that exists, and every ``#anchor`` at a
  heading of its page.
* Every ``bash`` block is marked (tests/doc_commands.py says how); every option of every command in them exists in
  the parser or config tree that reads it; ``check`` blocks resolve as the trainer resolves them; ``run`` blocks run,
  each page in a fresh directory, ``shardwise train`` on the worker pool with tiny values for what a command leaves
  unset (:func:`tiny_train`; docs/tests.md documents them), every other command in this process.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

import pytest

from tests.doc_commands import MARKERS, ROOT, blocks, commands, doc_files, flag_problems, program

if str(ROOT / "scripts") not in sys.path:
    sys.path.append(str(ROOT / "scripts"))
import gen_docs  # noqa: E402
from docgen import bench_page, config_ref  # noqa: E402
from docgen.markdown import anchors  # noqa: E402

SHELL = ("bash", "sh", "shell", "console")


def all_blocks():
    return [b for path in doc_files() for b in blocks(path)]


# ---- generated pages ---------------------------------------------------------------------------------------


def test_generated_pages_are_current():
    stale = gen_docs.stale()
    assert not stale, f"{', '.join(stale)} differ from what the code and results give: run python scripts/gen_docs.py"


def test_a_changed_field_docstring_changes_the_config_reference():
    source = (ROOT / "src" / "shardwise" / "config.py").read_text(encoding="utf-8")
    assert '    """Hidden size."""' in source
    mutated = source.replace('"""Hidden size."""', '"""Width of the residual stream."""')
    changed = config_ref.render(ROOT / "src", mutated)
    committed = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    assert changed != committed and "Width of the residual stream." in changed


def test_every_result_records_its_date_machine_and_command():
    """The benchmark page shows each result's date, machine and command: a JSON without them is refused here."""
    import json

    missing = []
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        if path.name.endswith(".trace.json"):
            continue
        doc = json.loads(path.read_text(encoding="utf-8"))
        doc = doc if isinstance(doc, dict) else {}
        lacks = [k for k, v in (("date", doc.get("date")), ("machine", bench_page.machine_of(doc)),
                                ("command", doc.get("command"))) if not v]
        if lacks:
            missing.append(f"bench/results/{path.name}: no {', '.join(lacks)}")
    assert not missing, "\n".join(missing)


# ---- links -------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The page without fenced blocks and inline code, where a bracket is not a link."""
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def test_every_relative_link_resolves():
    broken = []
    for page in doc_files():
        for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not file.exists() or ROOT not in file.parents and file != ROOT:
                broken.append(f"{where} -> no file {path}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{where} -> no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


# ---- commands ----------------------------------------------------------------------------------------------


def test_every_shell_block_is_marked():
    unmarked = [f"{b.where} ({b.marker or 'no marker'})" for b in all_blocks()
                if b.lang in SHELL and b.marker not in MARKERS]
    assert not unmarked, f"mark these with one of {', '.join(MARKERS)} (<!-- run --> ...):\n" + "\n".join(unmarked)


def test_every_option_in_the_docs_exists():
    problems = [f"{b.where}: {p}" for b in all_blocks() if b.lang in SHELL
                for c in commands(b.text) for p in flag_problems(c)]
    assert not problems, "\n".join(problems)


def test_checked_commands_resolve():
    from shardwise.cli import build_parser, split_overrides
    from shardwise.config import Config
    from shardwise.config_resolve import resolve

    checked = 0
    for b in all_blocks():
        if b.marker != "check":
            continue
        for c in commands(b.text):
            prog, args = program(c)
            assert prog == "shardwise" and args[0] == "train", f"{b.where}: a check block holds shardwise train only"
            rest, overrides = split_overrides(args[1:])
            parsed = build_parser().parse_args(["train", *rest])
            resolve(Config.load(parsed.config, overrides))
            checked += 1
    assert checked


TINY = {"train.steps": "2", "train.eval_every": "0", "train.eval_batches": "1", "ckpt.every": "0",
        "data.seq_len": "32", "data.max_bytes": "400000", "run.progress": "false", "run.tensorboard": "false"}
"""What a documented ``shardwise train`` gets for each field it leaves unset (docs/tests.md lists them)."""

MAX_STEPS = 8
"""A command's own ``--train.steps`` is kept up to this many."""


def tiny_train(overrides: dict[str, str], cache_dir: Path) -> dict[str, str]:
    """The command's own fields, plus tiny values for the rest: the tiny preset of its family (none under
    ``init_from``; fields the command gives, such as ``model.n_layers``, still apply), 2 steps (its own up to
    :data:`MAX_STEPS`), 24 sequences of 32 tokens."""
    from shardwise.model.presets import PRESETS

    out = {**{k: v for k, v in TINY.items() if k not in overrides}, **overrides}
    out["train.steps"] = str(min(int(out["train.steps"]), MAX_STEPS))
    if not {"train.global_batch", "train.micro_batch", "train.grad_accum"} & set(out):
        out["train.global_batch"] = "24"  # a multiple of every dp the docs use (1, 2, 3, 4, 8)
    preset = out.get("model.preset")
    if preset is None and "model.init_from" not in out:
        out["model.preset"] = "tiny"
    elif preset is not None and not preset.startswith("tiny"):
        spec = PRESETS.get(preset, {})
        out["model.preset"] = "tiny-moe" if spec.get("n_experts") else \
            "tiny-llama" if spec.get("flavor") == "llama" else "tiny"
    out["data.cache_dir"] = str(cache_dir)
    return out


def _train_on_rank(cfg, run_dir: str, cwd: str) -> None:
    from shardwise.worker import train

    here = os.getcwd()
    os.chdir(cwd)  # the command's relative paths (hf:out/..., tokenizer files) as the page's directory has them
    try:
        train(cfg, Path(run_dir))
    finally:
        os.chdir(here)


def run_train(args: list[str], page_dir: Path, cache_dir: Path, n: int) -> None:
    """A documented ``shardwise train``: the CLI's parsing and ``prepare_run`` here, the workers on the pool."""
    from shardwise.cli import build_parser, split_overrides
    from shardwise.config import Config
    from shardwise.launch import prepare_run
    from tests.harness import run_on_ranks

    rest, overrides = split_overrides(args)
    parsed = build_parser().parse_args(["train", *rest])
    if parsed.resume:
        overrides["ckpt.resume"] = "true"
    overrides = tiny_train(overrides, cache_dir)
    own_dir = "run.dir" not in overrides
    if own_dir:  # as the launcher names a run and points runs/latest at it
        overrides["run.dir"] = f"runs/doc-{n}"
    cfg, run_dir = prepare_run(Config.load(parsed.config, overrides))
    run_on_ranks(cfg.parallel.nproc * cfg.parallel.nnodes, _train_on_rank, cfg, str(run_dir.resolve()),
                 str(page_dir), timeout=600)
    if own_dir:
        latest = page_dir / "runs" / "latest"
        if latest.is_symlink():
            latest.unlink()
        latest.symlink_to(run_dir.resolve())


OUTPUTS = ("--plot", "--trace", "--out", "--json")


def run_in_process(args: list[str]) -> None:
    """Any other ``shardwise`` command, as ``shardwise.cli.main`` runs it, its output captured."""
    from shardwise.cli import main

    args = list(args)
    if args[0] == "generate":
        args = _set(args, "--max-new-tokens", "8")
    if args[0] == "simulate":
        args = _set(_set(args, "--ckpt-write-s-per-gb", "1", keep=True), "--ckpt-read-s-per-gb", "1", keep=True)
    if args[:2] == ["bench", "comm"]:
        args = _set(args, "--reps", "2")
    for flag in OUTPUTS:
        if flag in args and args.index(flag) + 1 < len(args):
            Path(args[args.index(flag) + 1]).parent.mkdir(parents=True, exist_ok=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    assert rc == 0, f"shardwise {' '.join(args)} exited {rc}:\n{err.getvalue()[-3000:]}"


def _set(args: list[str], flag: str, value: str, keep: bool = False) -> list[str]:
    if flag in args:
        return args if keep else [*args[:args.index(flag) + 1], value, *args[args.index(flag) + 2:]]
    return [*args, flag, value]


RUN_PAGES = sorted({b.path for b in all_blocks() if b.marker == "run"})


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_runnable_commands_run(page, tmp_path, cache_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # commands name the repository's configs/ as a clone has it
    n = 0
    for b in blocks(page):
        if b.marker != "run":
            continue
        for c in commands(b.text):
            prog, args = program(c)
            assert prog == "shardwise", f"{b.where}: a run block holds shardwise commands only, not {' '.join(c)}"
            if args[0] == "train":
                n += 1
                run_train(args[1:], tmp_path, cache_dir, n)
            else:
                run_in_process(args)


def test_readme_holds_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"
    assert test in readme and "-e '.[test]' && python -m pytest -q" in ci and "torch==2.13.0" in ci
    assert "pip install torch==2.13.0 && pip install -e . && shardwise train" in readme
