"""docs/benchmarks.md: one section per ``bench/results/*.json``, each with its date, machine and command, its
notes (how and when it was measured, earlier runs), its figures as tables and, when the file replaced earlier
results, their headlines (``history``, kept by :mod:`shardwise.bench_result`), one line each.

The tables are generic: every number the JSON holds is shown, nested records as rows, except lists of
per-step samples (say so in a line) and long text. :data:`VIEWS` narrows a few files whose JSON also holds raw
calibration data. A JSON added later needs nothing here: it gets a section under "Other results" (a topic in
:data:`TOPICS` places it beside its guide).
"""

from __future__ import annotations

import json
from pathlib import Path

from docgen.markdown import GENERATED, table
from shardwise.bench_result import machine_text

TOPICS: list[tuple[str, str, tuple[str, ...]]] = [
    ("The default run and the trainer", "getting-started.md", ("default_run", "default_compile", "overhead",
                                                                "generate")),
    ("Data parallelism and collectives", "data-parallel.md", ("ddp", "comm_", "compress")),
    ("ZeRO and offload", "zero.md", ("zero",)),
    ("Pipelines", "pipelines.md", ("pipeline", "pp_fsdp")),
    ("Tensor and sequence parallelism", "tensor-parallel.md", ("tp",)),
    ("Context parallelism", "context-parallel.md", ("cp",)),
    ("Experts", "experts.md", ("moe",)),
    ("Parameter server", "parameter-server.md", ("ps",)),
    ("Checkpoints, failover and several machines", "checkpoints.md", ("ckpt", "chaos", "multinode")),
    ("Hugging Face in and out", "huggingface.md", ("hf_",)),
    ("Simulating", "simulating.md", ("sim_",)),
    ("GPUs", "gpus.md", ("mfu", "offload_capacity")),
]
"""(heading, guide, file-name prefixes): where a result file's section goes; the first matching prefix wins."""

META = ("date", "machine", "command", "notes", "history", "benchmark", "source", "host", "platform", "cpu_count",
        "cpus", "torch")
"""Keys shown in a section's header (the machine's from what the JSON records of it), not in its tables."""

PATHS = ("json", "plot", "file")
"""Keys holding where a run wrote its files (temporary paths): left out at any depth."""

VIEWS: dict[str, dict] = {
    "sim_validate.json": {"drop": ("calibration", "measured_timeline", "simulated_timeline")},
    "sim_published.json": {"drop": ("hardware",)},
    "comm_allreduce_2.json": {"drop": ("model",)},
    "comm_allreduce_4.json": {"drop": ("model",)},
    "comm_allreduce_2_auto.json": {"drop": ("model",)},
    "comm_allreduce_2_auto_b.json": {"drop": ("model",)},
    "comm_allreduce_2_auto_c.json": {"drop": ("model",)},
    "comm_all_gather_4.json": {"drop": ("model",)},
    "comm_broadcast_4.json": {"drop": ("model",)},
    "comm_reduce_scatter_4.json": {"drop": ("model",)},
    "ps.json": {"drop": ("curve",)},
    "ps_4w2s.json": {"drop": ("curve",)},
}
"""Per file: keys (at any depth) left out of the tables -- raw calibration samples, timelines, curves that the
PNG beside the JSON draws."""

MAX_INLINE = 6
"""A list of at most this many numbers is shown in its cell; longer ones are per-step samples, left out."""

LONG_TEXT = 160


def is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def topic_of(name: str) -> int:
    for i, (_, _, prefixes) in enumerate(TOPICS):
        if name.startswith(prefixes):
            return i
    return len(TOPICS)


def machine_of(doc: dict) -> str | None:
    """The JSON's ``machine`` (a text, or the writer's measured description in one line), or what it records of
    the machine (host, CPUs, platform, torch)."""
    if doc.get("machine"):
        return machine_text(doc["machine"])
    host = doc.get("host")
    parts = []
    if isinstance(host, dict):
        parts += [str(host[k]) for k in ("platform", "cpus", "torch") if k in host]
    elif host:
        parts.append(str(host))
    for key, fmt in (("cpu_count", "{} CPUs"), ("platform", "{}"), ("torch", "torch {}")):
        if key in doc and is_scalar(doc[key]):
            parts.append(fmt.format(doc[key]))
    return ", ".join(parts) or None


class Section:
    """The tables of one result file."""

    def __init__(self, name: str, drop: tuple[str, ...]):
        self.name, self.drop = name, set(drop) | set(PATHS)
        self.lines: list[str] = []
        self.omitted: set[str] = set()

    def flatten(self, record: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in record.items():
            key = f"{prefix}{k}"
            if k in self.drop:
                continue
            if isinstance(v, dict):
                out.update(self.flatten(v, f"{key}."))
            elif isinstance(v, list):
                if len(v) <= MAX_INLINE and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                    out[key] = ", ".join(_num(x) for x in v)
                else:
                    self.omitted.add(key)
            elif isinstance(v, str) and len(v) > LONG_TEXT:
                self.omitted.add(key)
            else:
                out[key] = v
        return out

    def rows(self, title: str, labelled: list[tuple[str, dict]]) -> None:
        flat = [(label, self.flatten(r)) for label, r in labelled]
        columns: list[str] = []
        for _, r in flat:
            columns += [c for c in r if c not in columns]
        if not columns:
            return
        with_label = any(label for label, _ in flat)
        header = ([""] if with_label else []) + columns
        body = [([label] if with_label else []) + [r.get(c) for c in columns] for label, r in flat]
        self.lines += [f"**{title}**", ""] if title else []
        self.lines += table(header, body) + [""]

    def node(self, title: str, value) -> None:
        if isinstance(value, list):
            if all(isinstance(v, dict) for v in value) and value:
                self.rows(title, [("", v) for v in value])
            elif all(is_scalar(v) for v in value):
                if len(value) <= 3 * MAX_INLINE:
                    self.lines += [f"**{title}**: " + ", ".join(_num(v) for v in value), ""]
                else:
                    self.omitted.add(title.replace(" / ", "."))
            return
        if not isinstance(value, dict):
            return
        value = {k: v for k, v in value.items() if k not in self.drop}
        scalars = {k: v for k, v in value.items() if is_scalar(v)}
        nested = {k: v for k, v in value.items() if not is_scalar(v)}
        if scalars:
            self.rows(title, [("", scalars)])
        groups: list[list[str]] = []  # dict values that are rows of one table, in order of appearance
        for k, v in nested.items():
            if isinstance(v, dict):
                group = next((g for g in groups if _alike([nested[g[0]], v])), None)
                if group is None:
                    groups.append([k])
                else:
                    group.append(k)
        shown: set[str] = set()
        for k, v in nested.items():
            group = next((g for g in groups if k in g), None)
            if group and len(group) > 1:
                if k == group[0]:
                    self.rows(title or ", ".join(group),
                              [(g, nested[g]) for g in group])
                    for g in group:  # what a row's flattening left out (deeper tables) is shown below it
                        for kk, vv in nested[g].items():
                            if isinstance(vv, list) and vv and all(isinstance(x, dict) for x in vv):
                                self.node(f"{title} / {g} / {kk}" if title else f"{g} / {kk}", vv)
                    shown.update(group)
                continue
            if k not in shown:
                self.node(f"{title} / {k}" if title else k, v)


def _alike(records: list[dict]) -> bool:
    """Records that are rows of one table: each holds a scalar, and all share at least half of the keys of the
    smallest (``{"ours": {...}, "torch": {...}}``, not ``{"args": {...}, "median": {...}}``)."""
    if not all(any(is_scalar(x) for x in r.values()) for r in records):
        return False
    common = set.intersection(*(set(r) for r in records))
    return 2 * len(common) >= min(len(r) for r in records)


def _num(v) -> str:
    from docgen.markdown import cell

    return cell(v)


def section(path: Path) -> list[str]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(doc, list):
        doc = {"rows": doc}
    name = path.name
    lines = [f"### `{name}`", ""]
    if doc.get("benchmark"):
        lines += [str(doc["benchmark"]), ""]
    date, command, machine = doc.get("date"), doc.get("command"), machine_of(doc)
    lines += [f"- date: {date or 'not recorded'}",
              f"- machine: {machine or 'not recorded'}",
              f"- command: `{command}`" if command else "- command: not recorded"]
    if doc.get("source"):
        lines.append(f"- source: {doc['source']}")
    lines.append("")
    notes = doc.get("notes") or []
    notes = [notes] if isinstance(notes, str) else notes
    if notes:
        lines += ["Notes:", ""] + [f"- {' '.join(str(n).split())}" for n in notes] + [""]
    sec = Section(name, VIEWS.get(name, {}).get("drop", ()))
    sec.node("", {k: v for k, v in doc.items() if k not in META})
    lines += sec.lines
    if sec.omitted:
        lines += ["Left out here, in the JSON: " + ", ".join(f"`{k}`" for k in sorted(sec.omitted)) + ".", ""]
    lines += history_lines(doc.get("history") or [])
    return lines


def history_lines(history: list[dict]) -> list[str]:
    """The earlier results this file replaced, oldest first, one line each: date, machine, command and key
    figures, and where git holds the whole earlier file."""
    if not history:
        return []
    out = ["Earlier runs (replaced by the results above; oldest first):", ""]
    for h in history:
        head = f"{h.get('date') or 'date not recorded'}, {h.get('machine') or 'machine not recorded'}"
        if h.get("command"):
            head += f", `{h['command']}`"
        figures = "; ".join(f"{k} {_num(v)}" for k, v in (h.get("figures") or {}).items())
        if h.get("figures_left_out"):
            figures += f"; {h['figures_left_out']} more"
        where = f" (whole file: `git show {h['file_at']}`)" if h.get("file_at") else ""
        out.append(f"- {' '.join(head.split())}: {figures or 'no figures'}{where}")
    return out + [""]


def render(root: Path) -> str:
    results = root / "bench" / "results"
    files = sorted(p for p in results.glob("*.json") if not p.name.endswith(".trace.json"))
    lines = [
        "# Benchmarks",
        "",
        GENERATED.format(sources="`bench/results/*.json`"),
        "",
        "Every figure measured for shardwise, one section per result file, grouped by topic; the guides quote "
        "them and link here. Each file records when it was measured, on what machine and by which command; its "
        "notes say under what load and how it compares with earlier runs of the same command, and a file that "
        "replaced earlier results lists their headlines under \"Earlier runs\". Ratios are "
        "ours / the peer's, measured side by side in one invocation (absolute times on a shared machine drift). "
        "Chrome traces (`*.trace.json`) and plots (`*.png`) sit beside the JSON in `bench/results/`.",
        "",
    ]
    groups: dict[int, list[Path]] = {}
    for p in files:
        groups.setdefault(topic_of(p.name), []).append(p)
    headings = [(t, g) for t, g, _ in TOPICS] + [("Other results", "")]
    lines += ["Topics: " + ", ".join(f"[{headings[i][0]}](#{_slug(headings[i][0])})" for i in sorted(groups)) + ".",
              ""]
    for i in sorted(groups):
        heading, guide = headings[i]
        lines += [f"## {heading}", ""]
        if guide:
            lines += [f"The guide: [{guide}]({guide}).", ""]
        for p in groups[i]:
            lines += section(p)
    return "\n".join(lines).rstrip() + "\n"


def _slug(text: str) -> str:
    from docgen.markdown import slug

    return slug(text)
