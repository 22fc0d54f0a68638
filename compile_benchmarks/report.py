"""Turn pytest-benchmark JSON into ``RESULTS.md`` and ``ratios.png``.

Usage: ``python -m compile_benchmarks.report [RESULTS.json ...] [--out DIR]``
(``python -m compile_benchmarks.run`` calls it after the benchmarks). Without JSON files it
assembles the report from the stored result of every benchmark file
(``compile_benchmarks/results/<full|compile>/``, see ``store.py``): each section then names
the file, date and commit its rows come from, and a *Sources* table lists them all.

The repository's ``README.md`` shows a headline of the report: the rows of :data:`HEADLINE`
(what a user runs, against what they would use instead), read from the tables of
``RESULTS.md`` itself, so the committed report is all it needs.
``python -m compile_benchmarks.report --readme`` rewrites that table (between the
``<!-- bench:start -->`` and ``<!-- bench:end -->`` lines; ``make bench`` does it after the
report), ``--check-readme`` exits 1 when it differs; ``tests/test_readme_claims.py`` fails then, and
``tests/test_bench_report.py`` when the table is more than :data:`README_MAX_AGE_DAYS` older
than the newest commit of ``tdfunc/`` (:func:`stale_table_message`).

Every benchmark carries ``extra_info`` with ``workload``, ``mode``, ``contender`` (any name;
the canonical ones sort first), ``category`` and ``pass``; compiled ones add ``compile_s``,
``graphs``, ``graph_breaks`` and ``recompiles``. Per workload and mode the report gives each
contender's median time per call (median over passes of each pass's pytest-benchmark median)
and the ratios of tdfunc against tensordict, the pytree dict and the flat-list floor (median
over passes of the per-pass ratio, so contenders are only ever compared within one pass),
each with its spread (min-max over passes) when there are several passes; an appendix lists
every ratio pass by pass. Rows that cannot be trusted as they are (a compiled row slower than
its eager row, a ratio that moves more than 30% between passes) are listed as *suspect*, each
marked explained when ``compile_benchmarks/README.md`` names its workload in its
"Suspect rows" section.

The report holds tables and the chart only; how it is measured and why targets are missed are
written in ``compile_benchmarks/README.md``.

Example:
    >>> from compile_benchmarks.report import fmt_time
    >>> fmt_time(12.3456e-6)
    '12.3'
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compile_benchmarks import CONTENDERS, RUN_KINDS

HERE = Path(__file__).resolve().parent
COMPILED_MODES = ("compiled", "reduce-overhead")
TC_PAIRS = {"tdfunc": "tensordict", "tdfunc_tc": "tensordict_tc"}
SUBJECTS = ("tdfunc", "tdfunc_tc")
#: Comparators of the ratio columns after the tensordict counterpart, in display order.
DENOMINATORS = ("pytree", "torch_func", "numpy", "floor")
#: Categories of the end-to-end and torch.func workloads (targets against ``torch_func``).
TRANSFORM_CATEGORIES = ("nn", "workloads")
#: Eager container workloads held to the nested-container / integer-indexing floor target.
FLOOR_TARGET_WORKLOADS = ("add_one_nested", "add_self_nested", "index_int")
#: A ratio whose per-pass values differ by more than this factor minus one is suspect.
SUSPECT_SPREAD = 0.30
README = HERE / "README.md"
SUSPECT_SECTION = "## Suspect rows"
#: The README section with one ``###`` heading per missed target, named as the target.
ANALYSIS_SECTION = "## Why targets are missed"
#: Categories whose eager rows are held to the "container op" targets.
EAGER_TARGET_CATEGORIES = ("container", "tensorclass")
MISS = "✗"
MET = "✓"


# ----------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    """One target of the project: ``numerator/denominator <= limit`` (or ``== 0`` counts)."""

    key: str
    text: str
    limit: float


TARGETS = {
    "eager_vs_pytree": Target("eager_vs_pytree", "eager container ops: tdfunc <= 1.0x pytree", 1.0),
    "eager_vs_tensordict": Target(
        "eager_vs_tensordict", "eager container ops: tdfunc <= 0.7x tensordict", 0.7
    ),
    "eager_vs_floor": Target(
        "eager_vs_floor",
        "eager nested-container ops and integer indexing: tdfunc <= 1.2x floor",
        1.2,
    ),
    "eager_transforms": Target(
        "eager_transforms", "eager torch.func workloads: tdfunc <= 1.05x torch_func", 1.05
    ),
    "compiled_workloads": Target(
        "compiled_workloads", "compiled end-to-end workloads: tdfunc <= 1.05x torch_func", 1.05
    ),
    "replay": Target("replay", "replay sampling: tdfunc time <= 1.0x numpy (rows/s >= numpy)", 1.0),
    "compiled_vs_floor": Target(
        "compiled_vs_floor", "compiled per-call latency: tdfunc <= 1.15x floor", 1.15
    ),
    "cold_compile": Target("cold_compile", "cold compile: tdfunc <= 0.8x tensordict", 0.8),
    "graph_breaks": Target("graph_breaks", "zero graph breaks in every tdfunc workload", 0),
    "recompiles": Target("recompiles", "zero recompiles across 4 batch sizes with dynamic=True", 0),
}


# ----------------------------------------------------------------------------- data
@dataclass
class Entry:
    """All measurements of one contender in one (category, workload, mode)."""

    medians: dict[int, float] = field(default_factory=dict)  # pass -> median seconds
    iqr: dict[int, float] = field(default_factory=dict)
    rounds: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # extra_info of the first pass

    @property
    def median(self) -> float:
        return statistics.median(self.medians.values())

    @property
    def spread(self) -> tuple[float, float]:
        """Min and max over passes of the per-pass median."""
        return min(self.medians.values()), max(self.medians.values())


Key = tuple[str, str, str]  # (category, workload, mode)


@dataclass
class Results:
    """Benchmarks grouped as ``rows[(category, workload, mode)][contender] -> Entry``.

    ``runs`` (stored results only, see ``compile_benchmarks/store.py``): one entry per stored
    benchmark file (its file, kind, date, commit...), and ``sources`` the runs each row was
    read from.
    """

    rows: dict[Key, dict[str, Entry]]
    meta: dict[str, Any]
    machine: dict[str, Any]
    docs: dict[tuple[str, str], str]
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    sources: dict[Key, set[str]] = field(default_factory=dict)


def date_span(dates: Iterable[str]) -> str:
    """The days of ISO dates, as one day or ``first to last``.

    Example:
        >>> date_span(["2026-12-07T01:00:00+00:00", "2026-12-05T23:00:00+00:00"])
        '2026-12-05 to 2026-12-07'
    """
    days = sorted({d for text in dates for d in re.findall(r"\d{4}-\d{2}-\d{2}", str(text))})
    if not days:
        return "?"
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def _run_of(data: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The label and description of a stored result (``store.py``), None for plain JSON."""
    stamp = data.get("stamp")
    if not isinstance(stamp, dict) or "file" not in data:
        return None
    kind = str(data.get("kind", "full"))
    settings = data.get("settings") or {}
    return f"{kind}:{data['file']}", {
        "file": str(data["file"]),
        "kind": kind,
        "date": str(stamp.get("date", "?")),
        "commit": stamp.get("commit"),
        "dirty": bool(stamp.get("dirty")),
        "torch": stamp.get("torch"),
        "complete": bool(data.get("complete", True)),
        "seconds": data.get("seconds"),
        "passes": settings.get("passes"),
    }


def load(paths: Sequence[Path], shift_passes: bool = True) -> Results:
    """Read one or more pytest-benchmark JSON files. Passes of later files are shifted (they
    add passes to the rows of earlier files) unless ``shift_passes`` is false (stored results
    of distinct benchmark files); the metadata of a set of stored results is the newest
    ``make bench`` file's, its date the span of their dates."""
    rows: dict[Key, dict[str, Entry]] = defaultdict(dict)
    docs: dict[tuple[str, str], str] = {}
    meta: dict[str, Any] = {}
    machine: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}
    sources: dict[Key, set[str]] = defaultdict(set)
    metas: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []
    offset = 0
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        run = _run_of(data)
        if run is not None:
            runs[run[0]] = run[1]
            if data.get("tdfunc_bench"):
                metas.append(
                    (
                        run[1]["kind"],
                        run[1]["date"],
                        data["tdfunc_bench"],
                        data.get("machine_info") or {},
                    )
                )
        meta = meta or data.get("tdfunc_bench", {})
        machine = machine or data.get("machine_info", {})
        top = 0
        for b in data.get("benchmarks", []):
            info = b.get("extra_info", {})
            if not {"workload", "mode", "contender"} <= info.keys():
                continue
            cat = str(info.get("category", "other"))
            key = (cat, str(info["workload"]), str(info["mode"]))
            if run is not None:
                sources[key].add(run[0])
            entry = rows[key].setdefault(str(info["contender"]), Entry())
            p = int(info.get("pass", 0)) + offset
            top = max(top, p + 1)
            stats = b["stats"]
            entry.medians[p] = float(stats["median"])
            entry.iqr[p] = float(stats.get("iqr", 0.0))
            entry.rounds += int(stats.get("rounds", 0))
            if not entry.info or "compile_s" in info:
                entry.info = dict(info)
            if info.get("doc"):
                docs[(cat, str(info["workload"]))] = str(info["doc"])
        if shift_passes:
            offset += top
    if runs:
        if metas:
            full = [m for m in metas if m[0] == "full"] or metas
            _kind, _date, newest, machine = max(full, key=lambda m: m[1])
            meta = dict(newest)
        dates = [r["date"] for r in runs.values() if r["kind"] == "full"]
        meta["date"] = date_span(dates or [r["date"] for r in runs.values()])
        compile_runs = [r["date"] for r in runs.values() if r["kind"] == "compile"]
        if compile_runs:
            meta["compile_date"] = date_span(compile_runs)
    return Results(dict(rows), meta, machine, docs, runs, dict(sources))


def _source_text(run: dict[str, Any]) -> str:
    """``file`` date, commit (and whether it had uncommitted changes or is incomplete)."""
    commit = run.get("commit")
    text = f"`{run['file']}` {date_span([run['date']])}, " + (
        f"commit `{commit[:10]}`" if commit else "no commit"
    )
    if run.get("dirty"):
        text += " with uncommitted changes"
    if not run.get("complete", True):
        text += ", incomplete"
    return text


def measured_line(res: Results, keys: Iterable[Key]) -> list[str]:
    """The line that dates a section: the stored results its rows were read from.

    Example:
        >>> measured_line(Results({}, {}, {}, {}), [("c", "w", "eager")])
        []
    """
    labels = sorted({label for k in keys for label in res.sources.get(k, ())})
    if not labels:
        return []
    return [
        "Measured: " + "; ".join(_source_text(res.runs[label]) for label in labels) + ".",
        "",
    ]


def contender_order(names: Iterable[str]) -> list[str]:
    """Canonical contenders first, in their order, then the others alphabetically."""
    names = set(names)
    known = [c for c in CONTENDERS if c in names]
    return known + sorted(names - set(known))


def ratio(group: dict[str, Entry], num: str, den: str) -> tuple[float, float, float] | None:
    """Median, min and max over passes of ``num``'s median / ``den``'s median (same pass)."""
    a, b = group.get(num), group.get(den)
    if a is None or b is None:
        return None
    rs = [a.medians[p] / b.medians[p] for p in a.medians if p in b.medians and b.medians[p] > 0]
    if not rs:
        return None
    return statistics.median(rs), min(rs), max(rs)


def pass_ratios(group: dict[str, Entry], num: str, den: str) -> list[tuple[int, float]]:
    """``(pass, num/den)`` for every pass measured on both sides, in pass order."""
    a, b = group.get(num), group.get(den)
    if a is None or b is None:
        return []
    return [
        (p, a.medians[p] / b.medians[p])
        for p in sorted(a.medians)
        if p in b.medians and b.medians[p] > 0
    ]


def compile_ratio(group: dict[str, Entry], num: str, den: str) -> float | None:
    """Cold-compile time ratio (same backend on both sides), or None."""
    a, b = group.get(num), group.get(den)
    if a is None or b is None:
        return None
    ca, cb = a.info.get("compile_s"), b.info.get("compile_s")
    if ca is None or cb is None or cb <= 0 or a.info.get("backend") != b.info.get("backend"):
        return None
    return float(ca) / float(cb)


# ----------------------------------------------------------------------------- formatting
def fmt_time(seconds: float) -> str:
    """Microseconds with 3 significant digits."""
    us = seconds * 1e6
    if us >= 1000:
        return f"{us:,.0f}"
    if us >= 100:
        return f"{us:.0f}"
    if us >= 10:
        return f"{us:.1f}"
    return f"{us:.2f}"


def fmt_time_spread(e: Entry) -> str:
    """Median time with its min-max over passes (one pass: the median alone).

    Example:
        >>> fmt_time_spread(Entry(medians={0: 1e-5, 1: 2e-5, 2: 3e-5}))
        '20.0 [10.0-30.0]'
    """
    lo, hi = e.spread
    text = fmt_time(e.median)
    return text if len(e.medians) < 2 else f"{text} [{fmt_time(lo)}-{fmt_time(hi)}]"


def fmt_ratio(r: float | None, limit: float | None = None) -> str:
    """A ratio, flagged when it misses ``limit``."""
    if r is None:
        return "—"
    text = f"{r:.2f}"
    if limit is not None:
        text += f" {MISS}" if r > limit else ""
    return text


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table; ``|`` inside a cell (e.g. a graph-break reason) is escaped."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


@dataclass
class Miss:
    """One row that misses a target."""

    target: str
    category: str
    workload: str
    mode: str
    subject: str
    value: str


def _ratio_columns(group_names: set[str]) -> list[tuple[str, str, str]]:
    cols = []
    for subject in SUBJECTS:
        if subject not in group_names:
            continue
        for den in (TC_PAIRS[subject], *DENOMINATORS):
            if den in group_names:
                cols.append((f"{subject}/{den}", subject, den))
    return cols


def _limit(category: str, mode: str, den: str, workload: str = "") -> tuple[str, float] | None:
    if category == "replay" and den == "numpy":
        return "replay", TARGETS["replay"].limit
    if category in TRANSFORM_CATEGORIES and den == "torch_func":
        key = "eager_transforms" if mode == "eager" else "compiled_workloads"
        if mode == "eager" or category == "workloads":
            return key, TARGETS[key].limit
        return None
    if mode == "eager" and den == "floor" and workload in FLOOR_TARGET_WORKLOADS:
        return "eager_vs_floor", TARGETS["eager_vs_floor"].limit
    if mode == "eager" and category in EAGER_TARGET_CATEGORIES:
        if den in ("tensordict", "tensordict_tc"):
            return "eager_vs_tensordict", TARGETS["eager_vs_tensordict"].limit
        if den == "pytree":
            return "eager_vs_pytree", TARGETS["eager_vs_pytree"].limit
    if mode in COMPILED_MODES and den == "floor" and category not in TRANSFORM_CATEGORIES:
        return "compiled_vs_floor", TARGETS["compiled_vs_floor"].limit
    return None


def _unreachable(group: dict[str, Entry], den: str, limit: float) -> str:
    """A remark when ``limit`` x ``den`` is below the floor: no container can get there."""
    floors = [group[f].median for f in ("floor", "floor_foreach") if f in group]
    if den not in group or not floors or den in ("floor", "floor_foreach"):
        return ""
    target = limit * group[den].median
    best = min(floors)
    if target >= best:
        return ""
    return f"; unreachable: target {fmt_time(target)} µs < floor {fmt_time(best)} µs"


def _compiled_with_inductor(group: dict[str, Entry], *names: str) -> bool:
    return all(
        group.get(n) is not None and group[n].info.get("backend") == "inductor" for n in names
    )


# ----------------------------------------------------------------------------- sections
def timing_sections(res: Results, misses: list[Miss]) -> list[str]:
    """Per category and mode: medians per contender and the tdfunc ratios."""
    out: list[str] = []
    cats = sorted({k[0] for k in res.rows}, key=lambda c: (c != "container", c))
    for cat in cats:
        for mode in ("eager", *COMPILED_MODES):
            keys = [k for k in res.rows if k[0] == cat and k[2] == mode]
            if not keys:
                continue
            names = contender_order({c for k in keys for c in res.rows[k]})
            cols = _ratio_columns(set(names))
            out += [f"### {cat} — {mode}", "", *measured_line(res, keys)]
            header = ["workload", *[f"{c} µs" for c in names], *[c[0] for c in cols]]
            body = []
            for k in keys:
                group = res.rows[k]
                cells = [k[1]]
                cells += [fmt_time_spread(group[c]) if c in group else "" for c in names]
                for _label, num, den in cols:
                    r = ratio(group, num, den)
                    lim = _limit(cat, mode, den, k[1])
                    if mode != "eager" and not _compiled_with_inductor(group, num, den):
                        lim = None
                    text = fmt_ratio(None if r is None else r[0], None if lim is None else lim[1])
                    if r is not None and r[1] != r[2]:
                        text += f" [{r[1]:.2f}-{r[2]:.2f}]"
                    cells.append(text)
                    if r is not None and lim is not None and r[0] > lim[1]:
                        spread = f" (passes {r[1]:.2f} to {r[2]:.2f})" if r[1] != r[2] else ""
                        value = f"{r[0]:.2f}{spread}" + _unreachable(group, den, lim[1])
                        misses.append(Miss(lim[0], cat, k[1], mode, f"{num}/{den}", value))
                body.append(cells)
            out += [*_table(header, body), ""]
    return out


def compile_sections(res: Results, misses: list[Miss]) -> list[str]:
    """Cold compile times, graphs, graph breaks and recompiles of every compiled workload."""
    keys = [k for k in res.rows if k[2] in COMPILED_MODES]
    if not keys:
        return []
    names = contender_order({c for k in keys for c in res.rows[k]})
    out = [
        "## Compilation: cold compile, graphs, graph breaks, recompiles",
        "",
        *measured_line(res, keys),
        "### Cold compile (s)",
        "",
    ]
    pairs = [(s, TC_PAIRS[s]) for s in SUBJECTS if s in names and TC_PAIRS[s] in names]
    header = [
        "category",
        "workload",
        "mode",
        *[f"{c} s" for c in names],
        *[f"{a}/{b}" for a, b in pairs],
    ]
    body = []
    for k in keys:
        group = res.rows[k]
        cells = [k[0], k[1], k[2]]
        for c in names:
            e = group.get(c)
            cs = None if e is None else e.info.get("compile_s")
            cells.append("" if cs is None else f"{cs:.2f}")
        for a, b in pairs:
            r = compile_ratio(group, a, b)
            cells.append(fmt_ratio(r, TARGETS["cold_compile"].limit))
            if r is not None and r > TARGETS["cold_compile"].limit:
                misses.append(Miss("cold_compile", k[0], k[1], k[2], f"{a}/{b}", f"{r:.2f}"))
        body.append(cells)
    out += [*_table(header, body), ""]
    out += ["### graphs / graph breaks / recompiles (`·` = not probed)", ""]
    body = []
    for k in keys:
        group = res.rows[k]
        cells = [k[0], k[1], k[2]]
        for c in names:
            e = group.get(c)
            if e is None:
                cells.append("")
                continue
            g, b, r = e.info.get("graphs"), e.info.get("graph_breaks"), e.info.get("recompiles")
            bad = c in SUBJECTS and ((b or 0) > 0 or (r or 0) > 0)
            cell = " / ".join("·" if x is None else str(x) for x in (g, b, r))
            cell += f" {MISS}" if bad else ""
            again = int(e.info.get("recompiled_on_second_call", 0) or 0) + int(
                e.info.get("recompiled_while_timing", 0) or 0
            )
            cells.append(cell + (f" (+{again} on repeated calls)" if again else ""))
            if c in SUBJECTS and (b or 0) > 0:
                reasons = "; ".join(e.info.get("break_reasons", []))[:200]
                misses.append(Miss("graph_breaks", k[0], k[1], k[2], c, f"{b} ({reasons})"))
            if c in SUBJECTS and (r or 0) > 0:
                why = str(e.info.get("recompile_reason", ""))[:200]
                misses.append(Miss("recompiles", k[0], k[1], k[2], c, f"{r} ({why})"))
        body.append(cells)
    out += [*_table(["category", "workload", "mode", *names], body), ""]
    return out


def target_summary(res: Results, misses: list[Miss]) -> list[str]:
    """One line per target: how many rows were checked, and which missed."""
    checked: dict[str, int] = defaultdict(int)
    for (cat, _w, mode), group in res.rows.items():
        for subject in SUBJECTS:
            if subject not in group:
                continue
            for den in (TC_PAIRS[subject], *DENOMINATORS):
                lim = _limit(cat, mode, den, _w)
                if lim is None or den not in group:
                    continue
                if mode != "eager" and not _compiled_with_inductor(group, subject, den):
                    continue
                checked[lim[0]] += 1
            if mode in COMPILED_MODES:
                if compile_ratio(group, subject, TC_PAIRS[subject]) is not None:
                    checked["cold_compile"] += 1
                if group[subject].info.get("graph_breaks") is not None:
                    checked["graph_breaks"] += 1
                if group[subject].info.get("recompiles") is not None:
                    checked["recompiles"] += 1
    headings = analysis_headings()
    rows = []
    for key, t in TARGETS.items():
        missed = [m for m in misses if m.target == key]
        n = checked.get(key, 0)
        status = "not measured" if n == 0 else (f"{MET} met" if not missed else f"{MISS} missed")
        worst = ", ".join(sorted({m.workload for m in missed}))[:300]
        why = ""
        if missed:
            why = (
                f"[README](README.md#{github_anchor(t.text)})"
                if t.text in headings
                else f"{MISS} not analysed"
            )
        rows.append([t.text, str(n), str(len(missed)), status, worst, why])
    header = ["target", "rows checked", "rows missed", "status", "missed in", "why (measured)"]
    return [*_table(header, rows), ""]


def analysis_headings(readme: Path = README) -> set[str]:
    """The ``###`` headings of the README's section on missed targets (one per target)."""
    if not readme.exists():
        return set()
    out: set[str] = set()
    inside = False
    for line in readme.read_text().splitlines():
        if line.startswith("## "):
            inside = line.startswith(ANALYSIS_SECTION)
        elif inside and line.startswith("### "):
            out.add(line[4:].strip())
    return out


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading.

    Example:
        >>> github_anchor("cold compile: tdfunc <= 0.8x tensordict")
        'cold-compile-tdfunc--08x-tensordict'
    """
    kept = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def missed_rows(misses: list[Miss]) -> list[str]:
    """One table row per (target, workload, mode, ratio) that misses its target."""
    if not misses:
        return ["No target is missed.", ""]
    rows = [
        [TARGETS[m.target].text, m.workload, m.category, m.mode, m.subject, m.value]
        for m in sorted(misses, key=lambda m: list(TARGETS).index(m.target))
    ]
    header = ["target", "workload", "category", "mode", "ratio", "value"]
    return [*_table(header, rows), ""]


@dataclass
class Suspect:
    """One row whose numbers cannot be taken as they are."""

    category: str
    workload: str
    mode: str
    what: str
    value: str


def find_suspects(res: Results) -> list[Suspect]:
    """Compiled (inductor) rows slower than their eager row; ratios moving > 30% over passes."""
    out: list[Suspect] = []
    for (cat, w, mode), group in res.rows.items():
        if mode in COMPILED_MODES:
            eager = res.rows.get((cat, w, "eager"), {})
            for c in contender_order(group):
                e, ref = group[c], eager.get(c)
                if ref is None or e.info.get("backend") != "inductor":
                    continue
                if e.median > ref.median:
                    out.append(
                        Suspect(
                            cat,
                            w,
                            mode,
                            f"{c}: compiled slower than eager",
                            f"{fmt_time(e.median)} µs vs {fmt_time(ref.median)} µs "
                            f"({e.median / ref.median:.2f}x)",
                        )
                    )
        for _label, num, den in _ratio_columns(set(group)):
            rs = [r for _p, r in pass_ratios(group, num, den)]
            if len(rs) < 2 or min(rs) <= 0:
                continue
            if max(rs) / min(rs) - 1 > SUSPECT_SPREAD:
                out.append(
                    Suspect(
                        cat,
                        w,
                        mode,
                        f"{num}/{den} moves > {SUSPECT_SPREAD:.0%} between passes",
                        " ".join(f"{r:.2f}" for r in rs),
                    )
                )
    return out


def explained_workloads(readme: Path = README) -> set[str]:
    """Workload names written as code (backticks) in the README's suspect-rows section."""
    if not readme.exists():
        return set()
    text = readme.read_text()
    start = text.find(SUSPECT_SECTION)
    if start < 0:
        return set()
    end = text.find("\n## ", start + len(SUSPECT_SECTION))
    section = text[start : end if end >= 0 else len(text)]
    names: set[str] = set()
    parts = section.split("`")
    for i in range(1, len(parts), 2):
        names.add(parts[i].strip())
    return names


def suspect_section(res: Results, readme: Path = README) -> list[str]:
    """The suspect rows, each marked explained when the README's section names its workload."""
    suspects = find_suspects(res)
    out = ["## Suspect rows", ""]
    if not suspects:
        return [*out, "No suspect row.", ""]
    known = explained_workloads(readme)
    rows = [
        [
            s.category,
            s.workload,
            s.mode,
            s.what,
            s.value,
            f"{MET} README" if s.workload in known else f"{MISS} not yet",
        ]
        for s in sorted(suspects, key=lambda s: (s.category, s.workload, s.mode, s.what))
    ]
    n = sum(1 for r in rows if r[-1].startswith(MISS))
    out += [
        f"{len(rows)} suspect rows ({n} not explained in `compile_benchmarks/README.md`, "
        f"section *Suspect rows*).",
        "",
    ]
    header = ["category", "workload", "mode", "suspect", "value", "explained"]
    return [*out, *_table(header, rows), ""]


def per_pass_section(res: Results) -> list[str]:
    """Every ratio of the report, pass by pass."""
    rows = []
    for (cat, w, mode), group in sorted(res.rows.items()):
        for label, num, den in _ratio_columns(set(group)):
            rs = pass_ratios(group, num, den)
            if rs:
                rows.append([cat, w, mode, label, " ".join(f"{r:.2f}" for _p, r in rs)])
    if not rows:
        return []
    header = ["category", "workload", "mode", "ratio", "per pass"]
    return ["## Ratios per pass", "", *_table(header, rows), ""]


def replay_section(res: Results) -> list[str]:
    """Rows per second of the replay-sampling rows (``extra_info["rows"]`` per call)."""
    keys = [k for k in res.rows if k[0] == "replay"]
    if not keys:
        return []
    names = contender_order({c for k in keys for c in res.rows[k]})
    body = []
    for k in keys:
        group = res.rows[k]
        cells = [k[1]]
        for c in names:
            e = group.get(c)
            n = None if e is None else e.info.get("rows")
            cells.append("" if e is None or not n else f"{n / e.median:,.0f}")
        body.append(cells)
    return [
        "### replay — rows/s",
        "",
        *measured_line(res, keys),
        *_table(["workload", *[f"{c} rows/s" for c in names]], body),
        "",
    ]


def _infos(res: Results, *keys: str) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """``(category, workload, mode, contender, extra_info)`` of every row whose ``extra_info``
    has one of ``keys``, in report order."""
    return [
        (cat, workload, mode, name, group[name].info)
        for (cat, workload, mode), group in sorted(res.rows.items())
        for name in contender_order(group)
        if any(k in group[name].info for k in keys)
    ]


def memory_section(res: Results) -> list[str]:
    """Peak memory growth during one step (``extra_info["peak_param_sets"]``).

    Example:
        >>> memory_section(Results({}, {}, {}, {}))
        []
    """
    body = []
    found = _infos(res, "peak_param_sets")
    for cat, workload, mode, name, info in found:
        target = info.get("target")
        value = info["peak_param_sets"]
        met = "" if target is None else ("✓" if value <= target + 0.05 else MISS)
        body.append(
            [
                cat,
                workload,
                mode,
                name,
                f"{value:.2f}",
                "" if target is None else f"{target} {met}",
            ]
        )
    if not body:
        return []
    return [
        "### Peak memory — growth during one step, in parameter sets",
        "",
        "RSS high-water mark of a fresh process, reset after warm-up steps, minus the RSS "
        "before the step, divided by the bytes of the parameters (0.05 allowed for noise).",
        "",
        *measured_line(res, [r[:3] for r in found]),
        *_table(["category", "workload", "mode", "contender", "growth", "target"], body),
        "",
    ]


def first_call_section(res: Results) -> list[str]:
    """First call of a compiled step in a fresh process, cold and warm (``extra_info``
    ``cold_s`` / ``warm_s``: seconds per contender).

    Example:
        >>> first_call_section(Results({}, {}, {}, {}))
        []
    """
    body = []
    found = _infos(res, "cold_s", "extra_ms")
    for cat, workload, _mode, _name, info in found:
        if "extra_ms" in info:  # one call, no compilation: seconds per contender
            for who, sec in info["first_call_s"].items():
                body.append([cat, workload, who, f"{sec:.3f}", "", ""])
            continue
        for who, cold in info["cold_s"].items():
            warm = info["warm_s"][who]
            body.append([cat, workload, who, f"{cold:.1f}", f"{warm:.1f}", f"{warm / cold:.2f}"])
    if not body:
        return []
    return [
        "### First call in a fresh process — cold and warm compile caches",
        "",
        "Seconds for the first call; warm: a second process with the compile cache the first "
        "one left (targets: tdfunc cold <= 1.0x the dict step's, warm <= 0.2x cold). "
        "`first_functional_call`: an eager call, no compile cache (target: tdfunc at most "
        "torch.func's + 50 ms).",
        "",
        *measured_line(res, [r[:3] for r in found]),
        *_table(["category", "workload", "contender", "cold s", "warm s", "warm / cold"], body),
        "",
    ]


def paired_section(res: Results) -> list[str]:
    """Rows measured in paired rounds (``compile_benchmarks/paired.py``): ratio and A/A control.

    Example:
        >>> paired_section(Results({}, {}, {}, {}))
        []
    """
    body = []
    found = _infos(res, "ratio")
    for cat, workload, mode, name, info in found:
        if "aa" in info:
            target = info.get("target")
            met = "" if target is None else ("✓" if info["ratio"] <= target else MISS)
            body.append(
                [
                    cat,
                    workload,
                    mode,
                    f"{name} / {info.get('against', '?')}",
                    f"{info['ratio']:.2f} [{info['ratio_min']:.2f}-{info['ratio_max']:.2f}]",
                    f"{info['aa']:.2f} [{info['aa_min']:.2f}-{info['aa_max']:.2f}]"
                    + (f" (of `{info['aa_from']}`)" if info.get("aa_from") else ""),
                    "" if target is None else f"<= {target} {met}",
                ]
            )
    if not body:
        return []
    return [
        "### Paired rounds — ratio and A/A control",
        "",
        "Median of the per-round ratios `[min-max]` (A then B, order alternating); the A/A "
        "control is the same contender against an independent copy of itself (*of* a row: "
        "measured with that row, the same contender on the same data).",
        "",
        *measured_line(res, [r[:3] for r in found if "aa" in r[4]]),
        *_table(["category", "workload", "mode", "ratio of", "ratio", "A/A", "target"], body),
        "",
    ]


def machine_section(res: Results) -> list[str]:
    """Machine, versions and harness settings."""
    m = res.meta
    v = m.get("versions", {})
    cpu = m.get("cpu") or res.machine.get("cpu", {}).get("brand_raw", "?")
    mem = m.get("memory_gib")
    rows = [
        ["date", str(m.get("date", "?"))],
        *(
            [["date of the `make bench-compile` rows", m["compile_date"]]]
            if "compile_date" in m
            else []
        ),
        [
            "CPU",
            f"{cpu}, {m.get('cores', '?')} cores, torch threads {m.get('torch_threads', '?')}"
            + (f", {mem:.1f} GiB RAM" if mem else ""),
        ],
        ["GPU", str(m.get("cuda") or "none")],
        ["platform", str(m.get("platform", "?"))],
        ["python", str(m.get("python", "?"))],
        *[[name, str(ver)] for name, ver in v.items()],
        ["threads", _threads_text(m)],
        ["clock", _clock_text(str(m.get("timer", "time.perf_counter")))],
        ["mode", "quick (smoke test: 1 round, Dynamo-only backend)" if m.get("quick") else "full"],
        ["passes", str(m.get("passes", "?"))],
        ["recompile probe batch sizes", ", ".join(map(str, m.get("probe_sizes", [])))],
        [
            "one-time inductor start-up (excluded)",
            "—" if m.get("inductor_warmup_s") is None else f"{m['inductor_warmup_s']:.1f} s",
        ],
    ]
    return ["## Machine and versions", "", *_table(["", ""], rows), ""]


def sources_section(res: Results) -> list[str]:
    """One row per stored benchmark file the report was assembled from.

    Example:
        >>> sources_section(Results({}, {}, {}, {}))
        []
    """
    if not res.runs:
        return []
    body = []
    for run in sorted(res.runs.values(), key=lambda r: (r["kind"] != "full", r["file"])):
        commit = run.get("commit")
        secs = run.get("seconds")
        body.append(
            [
                f"`{run['file']}`",
                f"`{RUN_KINDS.get(run['kind'], run['kind'])}`",
                run["date"].replace("T", " "),
                (f"`{commit[:10]}`" if commit else "—")
                + (" + uncommitted changes" if run.get("dirty") else ""),
                str(run.get("torch") or "?"),
                str(run.get("passes") or "—"),
                "—" if secs is None else f"{secs / 60:.1f}",
                MET if run.get("complete", True) else f"{MISS} incomplete",
            ]
        )
    header = ["file", "measured by", "date", "commit", "torch", "passes", "minutes", "complete"]
    return [
        "## Sources",
        "",
        "Each benchmark file's rows come from its newest stored result "
        "(`compile_benchmarks/results/<kind>/<file>.json`, written as the file completed); "
        "`make bench` measures again only the files not measured yet for the commit checked "
        "out (`--force`: all).",
        "",
        *_table(header, body),
        "",
    ]


def _threads_text(meta: dict[str, Any]) -> str:
    t = meta.get("threads") or {}
    if not t:
        return f"torch {meta.get('torch_threads', '?')} (not fixed by the harness)"
    return (
        f"{t.get('threads')} (torch intra-op {t.get('torch_threads')}, inter-op "
        f"{t.get('interop_threads')}, OMP_NUM_THREADS={t.get('omp_num_threads_env')}, "
        f"inductor cpp.threads {t.get('inductor_cpp_threads')}; `--threads` to change)"
    )


def _clock_text(timer: str) -> str:
    if "process_time" in timer:
        return f"CPU time of the process (`{timer}`): waiting for a core is not counted"
    return f"wall clock (`{timer}`)"


def workloads_section(res: Results) -> list[str]:
    """The workload descriptions (first docstring line of each)."""
    if not res.docs:
        return []
    rows = [
        [c, w, d]
        for (c, w), d in sorted(res.docs.items(), key=lambda x: (x[0][0] != "container", x[0]))
    ]
    return ["## Workloads", "", *_table(["category", "workload", "what"], rows), ""]


def render(res: Results, chart: str | None = None, title: str = "tdfunc benchmark results") -> str:
    """The whole RESULTS.md text."""
    misses: list[Miss] = []
    timing = timing_sections(res, misses)
    comp = compile_sections(res, misses)
    lines = [
        f"# {title}",
        "",
        "Generated by `python -m compile_benchmarks.run`; do not edit by hand. How it is "
        "measured, how to read it and why targets are missed: `compile_benchmarks/README.md`.",
        "",
        f"Times: median µs per call. Ratios: tdfunc time / other time. {MISS}: misses its target.",
        "",
    ]
    if res.meta.get("quick"):
        lines += ["> **Quick smoke run** (1 round, Dynamo-only backend): not measurements.", ""]
    lines += ["## Targets", "", *target_summary(res, misses)]
    if chart:
        lines += [f"![tdfunc ratios]({chart})", ""]
    lines += [
        "## Per-call times and ratios",
        "",
        "Cells: median over passes `[min-max over passes]`; ratios: median of the per-pass "
        "ratios `[min-max]`.",
        "",
        *timing,
        *replay_section(res),
        *paired_section(res),
        *memory_section(res),
        *first_call_section(res),
        *comp,
    ]
    lines += [*suspect_section(res)]
    lines += ["## Missed targets", "", *missed_rows(misses)]
    lines += [*machine_section(res), *sources_section(res)]
    lines += [*workloads_section(res), *per_pass_section(res)]
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------- chart
CHART_SERIES = ("tensordict", "pytree", "torch_func", "floor")


def chart(res: Results, path: Path) -> bool:
    """A PNG of tdfunc's ratios (vs tensordict, pytree, floor) per workload, eager and compiled;
    False (nothing written) when no row has one."""
    panels = []
    for mode, limits in (
        ("eager", {"tensordict": 0.7, "pytree": 1.0}),
        ("compiled", {"floor": 1.15, "torch_func": 1.05}),
    ):
        labels, series = [], defaultdict(list)
        for (cat, w, md), group in sorted(
            res.rows.items(), key=lambda x: (x[0][0] != "container", x[0])
        ):
            if md != mode:
                continue
            subject = (
                "tdfunc" if "tdfunc" in group else ("tdfunc_tc" if "tdfunc_tc" in group else None)
            )
            if subject is None:
                continue
            vals = {}
            for den in (TC_PAIRS[subject], "pytree", "torch_func", "floor"):
                r = ratio(group, subject, den)
                vals["tensordict" if den.startswith("tensordict") else den] = (
                    None if r is None else r[0]
                )
            if all(v is None for v in vals.values()):
                continue
            labels.append(
                w if cat == "container" else f"{cat}/{w}" + ("" if subject == "tdfunc" else " (tc)")
            )
            for den in CHART_SERIES:
                series[den].append(vals.get(den))
        if labels:
            panels.append((mode, labels, series, limits))
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = max(4.0, 0.22 * max(len(p[1]) for p in panels) + 1.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), height), squeeze=False)
    colors = {
        "tensordict": "tab:orange",
        "pytree": "tab:blue",
        "torch_func": "tab:green",
        "floor": "tab:gray",
    }
    for ax, (mode, labels, series, limits) in zip(axes[0], panels):
        ys = range(len(labels))
        h = 0.2
        for i, den in enumerate(CHART_SERIES):
            vals = [v if v is not None else float("nan") for v in series[den]]
            ax.barh(
                [y + (i - 1.5) * h for y in ys],
                vals,
                height=h,
                color=colors[den],
                label=f"tdfunc / {den}",
            )
        ax.axvline(1.0, color="black", lw=0.8)
        for den, lim in limits.items():
            ax.axvline(lim, color=colors[den], ls="--", lw=1, label=f"target vs {den}: {lim}x")
        ax.set_xscale("log")
        lo, hi = ax.get_xlim()
        ax.set_xlim(max(lo, 0.1), min(hi, 10.0))  # copies vs a list(l) floor go off the scale
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(
            f"{mode}: tdfunc time / comparator time (lower is better; clipped to 0.1-10)",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(axis="x", which="both", alpha=0.3)
    if res.runs:
        fig.suptitle(f"measured {res.meta.get('date', '?')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- README headline
#: The lines between which the repository's README holds the generated benchmark table.
HEADLINE_START = "<!-- bench:start -->"
HEADLINE_END = "<!-- bench:end -->"
RESULTS_MD = HERE / "RESULTS.md"
ROOT_README = HERE.parent / "README.md"
#: The RESULTS.md sections the headline reads besides the per-workload tables.
PAIRED_SECTION = "Paired rounds — ratio and A/A control"
TARGETS_SECTION = "Targets"
MACHINE_SECTION = "Machine and versions"
NO_MARKERS = (
    "{path}: no benchmark table between {start!r} and {end!r} (one line each, in that order)"
)
NO_MACHINE = (
    "{path}: no '## {section}' table (is it a report written by compile_benchmarks.report?)"
)
QUICK_HEADLINE = (
    "{path} is a quick smoke run (one round): its ratios are not measurements; "
    "run `make bench` for the README's table"
)
NO_HEADLINE_ROW = "{path}: none of the README's headline rows is in this report"


@dataclass(frozen=True)
class Headline:
    """One row of the README's benchmark table, read from a table of ``RESULTS.md``.

    ``kind`` says where: ``"ratio"``, the column ``ratio`` (``"tdfunc/torch_func"``) of
    ``workload`` in the per-workload table ``section`` (``"workloads — compiled"``), held to the
    report's target of that cell; ``"paired"``, the row of ``workload``, ``mode`` and ``ratio``
    (the *ratio of* cell, ``"tdfunc / torch_optim"``) in the paired-rounds table, held to its
    own target; ``"target"``, the row of the *Targets* table named ``workload``.
    """

    what: str
    against: str
    kind: str
    workload: str
    section: str = ""
    ratio: str = ""
    mode: str = ""


#: The README's headline, in order: what a user runs, against what they would use instead. A
#: row whose measurement is not in the report (e.g. paired rows of an older run) is left out.
HEADLINE: tuple[Headline, ...] = (
    Headline(
        "compiled MLP training step",
        "`torch.func` on a flat dict",
        "ratio",
        "train_step_mlp",
        "workloads — compiled",
        "tdfunc/torch_func",
    ),
    Headline(
        "compiled GPT-2 training step, AdamW, donated",
        "`torch.func` + compiled `torch.optim.AdamW`",
        "paired",
        "train_step_gpt2",
        ratio="tdfunc_donated / torch_func",
        mode="compiled",
    ),
    Headline(
        "eager MLP training step",
        "`torch.func` on a flat dict",
        "ratio",
        "train_step_mlp",
        "workloads — eager",
        "tdfunc/torch_func",
    ),
    Headline(
        "compiled vmap ensemble of 8 MLPs, forward + backward",
        "`torch.func` on a flat dict",
        "ratio",
        "ensemble_forward_backward",
        "workloads — compiled",
        "tdfunc/torch_func",
    ),
    Headline(
        "compiled AdamW step (GPT-2 parameters)",
        "compiled `torch.optim.AdamW`",
        "paired",
        "optim_step",
        ratio="tdfunc / torch_optim",
        mode="compiled",
    ),
    Headline(
        "eager `td + 1`, 50 leaves",
        "tensordict",
        "ratio",
        "add_one_flat",
        "container — eager",
        "tdfunc/tensordict",
    ),
    Headline(
        "eager tensorclass construction",
        "tensordict `@tensorclass`",
        "ratio",
        "tc_create",
        "tensorclass — eager",
        "tdfunc_tc/tensordict_tc",
    ),
    Headline(
        "eager `td + 1`, 10-deep nesting",
        "a flat list of the same tensors",
        "ratio",
        "add_one_nested",
        "container — eager",
        "tdfunc/floor",
    ),
    Headline(
        "replay sampling, 256 rows of a 1 GiB store",
        "`numpy.memmap`",
        "ratio",
        "replay_sample_256",
        "replay — eager",
        "tdfunc/numpy",
    ),
    Headline(
        "graph breaks, every compiled tdfunc workload",
        "—",
        "target",
        TARGETS["graph_breaks"].text,
    ),
)


def _cells(line: str) -> list[str]:
    """The cells of one Markdown table row (``\\|`` inside a cell is not a separator)."""
    inner = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    parts, cur, i = [], "", 0
    while i < len(inner):
        if inner[i] == "\\" and inner[i + 1 : i + 2] == "|":
            cur, i = cur + "|", i + 2
            continue
        if inner[i] == "|":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += inner[i]
        i += 1
    return [*parts, cur.strip()]


def md_tables(text: str) -> dict[str, list[list[str]]]:
    r"""The first table under each heading of a Markdown text: heading (without ``#``) -> its
    rows of cells, the header row first.

    Example:
        >>> md_tables("## T\n\n| a | b |\n|---|---|\n| 1 | x \\| y |\n")
        {'T': [['a', 'b'], ['1', 'x | y']]}
    """
    out: dict[str, list[list[str]]] = {}
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif (
            line.startswith("|")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("|---")
            and heading not in out
        ):
            rows = [_cells(line)]
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out[heading] = rows
            continue
        i += 1
    return out


_NUMBER = r"(\d+(?:\.\d+)?)"


def _ratio_cell(cell: str) -> tuple[float, float | None, float | None] | None:
    """Median and spread of a report ratio cell (``"2.36 ✗ [2.11-2.37]"``), None for ``—``."""
    m = re.match(_NUMBER, cell.strip())
    if m is None:
        return None
    spread = re.search(rf"\[{_NUMBER}-{_NUMBER}\]", cell)
    lo, hi = (float(spread[1]), float(spread[2])) if spread else (None, None)
    return float(m[1]), lo, hi


def _records(tables: dict[str, list[list[str]]], heading: str) -> list[dict[str, str]]:
    """The rows of the table under ``heading`` as dicts from column name to cell."""
    header, *rows = tables.get(heading) or [[]]
    return [dict(zip(header, row)) for row in rows]


def _headline_row(h: Headline, tables: dict[str, list[list[str]]]) -> list[str] | None:
    """``[workload, against, ratio, target]`` cells of one headline row, None when absent."""
    if h.kind == "target":
        row = next(
            (r for r in _records(tables, TARGETS_SECTION) if r.get("target") == h.workload), None
        )
        if row is None or row.get("rows checked", "0") == "0":
            return None
        missed = int(row["rows missed"])
        what = f"{h.what} ({row['rows checked']})"
        return [what, h.against, str(missed), f"0 {MET if missed == 0 else MISS}"]
    if h.kind == "paired":
        rows = _records(tables, PAIRED_SECTION)
        row = next(
            (
                r
                for r in rows
                if (r.get("workload"), r.get("mode"), r.get("ratio of"))
                == (h.workload, h.mode, h.ratio)
            ),
            None,
        )
        if row is None:
            return None
        value = _ratio_cell(row.get("ratio", ""))
        m = re.search(rf"<=\s*{_NUMBER}", row.get("target", ""))
        limit = None if m is None else float(m[1])
    else:
        row = next(
            (r for r in _records(tables, h.section) if r.get("workload") == h.workload), None
        )
        if row is None:
            return None
        value = _ratio_cell(row.get(h.ratio, ""))
        category, _, mode = h.section.partition(" — ")
        lim = _limit(category, mode, h.ratio.split("/")[1], h.workload)
        limit = None if lim is None else lim[1]
    if value is None:
        return None
    med, lo, hi = value
    text = f"{med:.2f}x" + ("" if lo is None or lo == hi else f" ({lo:.2f}-{hi:.2f})")
    target = "" if limit is None else f"≤ {limit:.2f}x {MET if med <= limit else MISS}"
    return [h.what, h.against, text, target]


def _run_line(tables: dict[str, list[list[str]]], path: Path) -> str:
    """When, with which torch and on which machine the report was measured."""
    rows = tables.get(MACHINE_SECTION, [])[1:]
    if not rows:
        raise ValueError(NO_MACHINE.format(path=path, section=MACHINE_SECTION))
    m = {row[0]: row[-1] for row in rows}
    if m.get("mode", "").startswith("quick"):
        raise ValueError(QUICK_HEADLINE.format(path=path))
    clock = "CPU-time clock" if "process_time" in m.get("clock", "") else "wall clock"
    threads = m.get("threads", "?").split(" ")[0]
    gpu = m.get("GPU", "none")
    return (
        f"`make bench` of {date_span([m.get('date', '?')])}: torch {m.get('torch', '?')}, "
        f"{m.get('CPU', '?')}" + ("" if gpu == "none" else f", {gpu}") + f"; {threads} "
        f"thread{'s' if threads != '1' else ''}, {clock}, medians of {m.get('passes', '?')} "
        "interleaved passes."
    )


def headline(results_md: str, path: Path = RESULTS_MD) -> str:
    """The README's benchmark block (markers included), written from the text of a full
    report's ``RESULTS.md``: the run line and the :data:`HEADLINE` rows it measured.

    Example:
        >>> block = headline(RESULTS_MD.read_text(encoding="utf-8"))
        >>> block.splitlines()[0] == HEADLINE_START, "| workload |" in block
        (True, True)
    """
    tables = md_tables(results_md)
    run = _run_line(tables, path)
    rows = [r for h in HEADLINE if (r := _headline_row(h, tables)) is not None]
    if not rows:
        raise ValueError(NO_HEADLINE_ROW.format(path=path))
    return "\n".join(
        [
            HEADLINE_START,
            "<!-- written by `python -m compile_benchmarks.report --readme` from "
            "compile_benchmarks/RESULTS.md: do not edit -->",
            run,
            "Ratio: tdfunc's time over the alternative's (below 1: tdfunc is faster), median "
            f"over passes (min-max); {MISS}: misses the project's target. Every row, and why "
            "a target is missed: [`RESULTS.md`](compile_benchmarks/RESULTS.md), "
            "[how it is measured](compile_benchmarks/README.md).",
            "",
            *_table(["workload", "tdfunc against", "ratio", "target"], rows),
            HEADLINE_END,
        ]
    )


def readme_block(readme_text: str, path: Path = ROOT_README) -> tuple[int, int]:
    """Start and end offsets of the generated block in a README's text (markers included)."""
    start = readme_text.find(HEADLINE_START + "\n")
    end = readme_text.find("\n" + HEADLINE_END, max(start, 0))
    if start < 0 or end < 0 or readme_text.count(HEADLINE_START) != 1:
        raise ValueError(NO_MARKERS.format(path=path, start=HEADLINE_START, end=HEADLINE_END))
    return start, end + 1 + len(HEADLINE_END)


def with_headline(readme_text: str, block: str, path: Path = ROOT_README) -> str:
    r"""The README's text with its generated block replaced by ``block``.

    Example:
        >>> text = f"# x\n{HEADLINE_START}\nold\n{HEADLINE_END}\nend\n"
        >>> with_headline(text, f"{HEADLINE_START}\nnew\n{HEADLINE_END}")
        '# x\n<!-- bench:start -->\nnew\n<!-- bench:end -->\nend\n'
    """
    start, end = readme_block(readme_text, path)
    return readme_text[:start] + block + readme_text[end:]


def write_headline(readme: Path = ROOT_README, results: Path = RESULTS_MD) -> bool:
    """Rewrite the README's benchmark block from ``results``; True when it changed."""
    text = readme.read_text(encoding="utf-8")
    new = with_headline(text, headline(results.read_text(encoding="utf-8"), results), readme)
    if new != text:
        readme.write_text(new, encoding="utf-8")
    return new != text


# ----------------------------------------------------------------------------- README age
#: The README's benchmark table may be this many days older than the newest commit of
#: ``tdfunc/``, no more (``tests/test_bench_report.py`` fails otherwise).
README_MAX_AGE_DAYS = 14
NO_TABLE_DATE = (
    "{path}: the benchmark table carries no date (a line '`make bench` of YYYY-MM-DD: ...' "
    "between {start!r} and {end!r})"
)
STALE_TABLE = (
    "{path}: the benchmark table was measured on {table}, but tdfunc/ changed on {changed}, "
    "{days} days later (at most {limit} allowed): run `make bench` on an idle machine (it "
    "resumes where it stopped and rewrites the table)"
)


def readme_table_date(readme_text: str, path: Path = ROOT_README) -> datetime.date:
    r"""The day the README's benchmark table was measured (the first day of its run line, the
    oldest when the report spans several days).

    Example:
        >>> run = "`make bench` of 2026-12-01 to 2026-12-03: torch 2.13.0"
        >>> readme_table_date(f"{HEADLINE_START}\n{run}\n{HEADLINE_END}")
        datetime.date(2026, 12, 1)
    """
    start, end = readme_block(readme_text, path)
    m = re.search(r"`make bench` of (\d{4}-\d{2}-\d{2})", readme_text[start:end])
    if m is None:
        raise ValueError(NO_TABLE_DATE.format(path=path, start=HEADLINE_START, end=HEADLINE_END))
    return datetime.date.fromisoformat(m[1])


def newest_change(root: Path = HERE.parent, path: str = "tdfunc") -> datetime.datetime:
    """When ``root/path`` last changed: the commit date of the newest commit touching it, or,
    outside a git checkout (or before its first commit), the newest modification time of its
    files."""
    from compile_benchmarks.store import git

    out = (git(Path(root), "log", "-1", "--format=%cI", "--", path) or "").strip()
    if out:
        return datetime.datetime.fromisoformat(out)
    files = [
        p for p in (Path(root) / path).rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ]
    if not files:
        raise ValueError(f"{Path(root) / path}: no file to date")
    newest = max(p.stat().st_mtime for p in files)
    return datetime.datetime.fromtimestamp(newest, tz=datetime.UTC)


def stale_table_message(
    table: datetime.date,
    changed: datetime.datetime,
    limit: int = README_MAX_AGE_DAYS,
    path: Path = ROOT_README,
) -> str | None:
    """Why the README's table (measured on ``table``) is stale against a change to the library
    on ``changed``, or None when it is at most ``limit`` days older.

    Example:
        >>> import datetime as dt
        >>> stale_table_message(dt.date(2026, 12, 1), dt.datetime(2026, 12, 15, 23)) is None
        True
        >>> "16 days later" in stale_table_message(dt.date(2026, 12, 1), dt.datetime(2026, 12, 17))
        True
    """
    days = (changed.date() - table).days
    if days <= limit:
        return None
    return STALE_TABLE.format(
        path=path, table=table, changed=changed.date(), days=days, limit=limit
    )


# ----------------------------------------------------------------------------- entry point
def write_report(
    json_paths: Sequence[Path],
    out_dir: Path,
    title: str = "tdfunc benchmark results",
    shift_passes: bool = True,
) -> Path:
    """Write ``RESULTS.md`` and ``ratios.png`` into ``out_dir``; return the Markdown path.
    ``shift_passes``: see :func:`load` (false for stored results of distinct files)."""
    res = load(json_paths, shift_passes)
    if not res.rows:
        raise ValueError(
            f"no benchmark with workload/mode/contender extra_info in {list(map(str, json_paths))}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "ratios.png"
    has_chart = chart(res, png)
    md = out_dir / "RESULTS.md"
    md.write_text(render(res, png.name if has_chart else None, title))
    return md


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "json",
        nargs="*",
        type=Path,
        help="pytest-benchmark JSON file(s); none: the stored results of make bench and "
        "make bench-compile (compile_benchmarks/results/<kind>/)",
    )
    parser.add_argument("--out", type=Path, default=HERE, help="output directory (default: here)")
    parser.add_argument(
        "--readme",
        action="store_true",
        help="rewrite the README's benchmark table from RESULTS.md (no JSON needed)",
    )
    parser.add_argument(
        "--check-readme",
        action="store_true",
        help="exit 1 when the README's benchmark table differs from what RESULTS.md gives",
    )
    args = parser.parse_args(argv)
    if args.readme or args.check_readme:
        want = headline(RESULTS_MD.read_text(encoding="utf-8"))
        text = ROOT_README.read_text(encoding="utf-8")
        if with_headline(text, want) == text:
            print(f"{ROOT_README}: benchmark table up to date")
            return 0
        if args.check_readme:
            print(f"{ROOT_README}: benchmark table differs from {RESULTS_MD}")
            return 1
        write_headline()
        print(f"wrote the benchmark table of {ROOT_README}")
        return 0
    if args.json:
        md = write_report(args.json, args.out)
    else:
        from compile_benchmarks.store import RESULTS, stored_paths

        paths = stored_paths()
        if not paths:
            parser.error(f"no stored result in {RESULTS}: give JSON file(s) or run make bench")
        md = write_report(paths, args.out, shift_passes=False)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
