"""Turn a results store into tables and plots a person reads at a glance: report.html + PNGs.

Per (model, mode, length): score vs measured KV ratio, one line per method and the full cache
as a dashed reference, one panel per task; a table of mean score per budget with the best
of each column in bold (and relative to the full cache); a speed table.
"""

from __future__ import annotations

import html
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.bench.store import read_rows

Group = tuple[str, str, int]  # model, mode, length


@dataclass(frozen=True)
class Point:
    """Means over the samples of one cell."""

    method: str
    budget: str
    task: str
    score: float
    kv_ratio: float
    n: int
    prefill_s: float
    compress_s: float
    decode_tokens_per_s: float
    peak_rss_mb: float = math.nan
    kl: float = math.nan  # fidelity: mean KL(full || compressed) per token
    ppl: float = math.nan  # fidelity: median perplexity of the real continuation


def aggregate(rows: Iterable[dict[str, Any]]) -> dict[Group, list[Point]]:
    """Rows -> per group, one Point per (method, budget, task)."""
    cells: dict[tuple[Group, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[((r["model"], r["mode"], r["length"]), r["method"], r["budget"], r["task"])].append(r)
    out: dict[Group, list[Point]] = defaultdict(list)
    for (group, method, budget, task), rs in sorted(cells.items()):
        out[group].append(
            Point(
                method,
                budget,
                task,
                score=statistics.fmean(r["score"] for r in rs),
                kv_ratio=_mean(r["kv_ratio"] for r in rs),
                n=len(rs),
                prefill_s=_median(r["prefill_s"] for r in rs),
                compress_s=_median(r["compress_s"] for r in rs),
                decode_tokens_per_s=_median(r["decode_tokens_per_s"] for r in rs),
                kl=_mean(r["kl"] for r in rs),
                ppl=_median(r["ppl"] for r in rs),
                peak_rss_mb=max((r["peak_rss_mb"] for r in rs if r["peak_rss_mb"] is not None), default=math.nan),
            )
        )
    return dict(out)


def budgets_of(points: list[Point]) -> list[str]:
    """Budgets of a group, largest first (fractions, then token budgets)."""

    def key(b: str) -> tuple[int, float]:
        return (1, -float(b[:-1])) if b.endswith("t") else (0, -float(b))

    return sorted({p.budget for p in points if p.method != "full"}, key=key)


def plot_group(group: Group, points: list[Point], path: Path) -> None:
    """Score vs KV ratio, one panel per task."""
    try:
        import matplotlib
    except ImportError:
        from kvstack.errors import UserError

        raise UserError("plots need matplotlib: pip install 'kvstack[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    tasks = sorted({p.task for p in points})
    columns = min(len(tasks), 4)
    rows = -(-len(tasks) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    methods = sorted(plotted(points), key=lambda m: (m.startswith("kvpress:"), m))
    styles = line_styles(methods)
    shown = len([m for m in methods if not m.startswith("kvpress:")])
    total = len({p.method for p in points if p.method != "full" and not p.method.startswith("kvpress:")})
    for ax, task in zip(axes.flat, tasks, strict=False):
        for p in points:
            if p.task == task and p.method == "full":
                ax.axhline(p.score, color="black", linestyle="--", linewidth=1, label="full cache")
        for method in methods:
            line = sorted(
                (p.kv_ratio, p.score)
                for p in points
                if p.task == task and p.method == method and math.isfinite(p.kv_ratio)  # unmeasured: no place
            )
            if line:
                ax.plot(*zip(*line, strict=True), label=method, **styles[method])
        ax.set_title(task)
        ax.set_xlabel("KV bytes held / full (measured)")
        ax.set_xscale("log", base=2)
        lo = min((p.kv_ratio for p in points if p.kv_ratio > 0), default=1.0) / 1.4  # NaN compares False
        ax.set_xticks([2.0**-k for k in range(12) if 2.0**-k >= lo])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlim(lo, 1.15)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("score")
    legend: dict[str, Any] = {}  # every method once, whichever panels it appears in
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(
        list(legend.values()), list(legend), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False
    )
    model, mode, length = group
    best = f" - the {shown} best of {total} methods by mean score" if shown < total else ""
    fig.suptitle(f"{model} - {tokens_label(length)} - {mode_label(mode)}{best}")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def kvstack_method(rival: str, methods: Iterable[str] | None = None) -> str | None:
    """`kvpress:snapkv` -> `snapkv`: the kvstack method implementing the same paper, if any; among
    `methods`, its label with default parameters (`kvpress:adakv` -> `adakv(snapkv)`)."""
    from kvstack.bench.rivals.kvpress_rival import COUNTERPART
    from kvstack.stack import Stack

    press = rival.partition(":")[2]
    name = next((m for m, p in COUNTERPART.items() if p == press), None)
    if name is None or methods is None:
        return name
    label = Stack.parse(name).label
    return label if label in set(methods) else None


def paper_of(method: str) -> str:
    """The paper a result line belongs to: `adakv(snapkv)` and `kvpress:adakv` -> `adakv`; a stack
    (`kvzip+adaquant(residual=32)`) is its own line, apart from its scorer's."""
    if method.startswith("kvpress:"):
        return kvstack_method(method) or method
    if "+" in method:
        return method
    return method.split("(")[0]


PLOT_LINES = 8  # kvstack methods drawn per plot (the best by mean score), beside their kvpress counterparts


def plotted(points: list[Point], top: int = PLOT_LINES) -> list[str]:
    """The methods a plot draws: the `top` kvstack methods by mean score over every budget, their
    kvpress counterparts, and any kvpress press without a counterpart (a crowded plot reads at a
    glance no more; the tables list every method)."""
    ours = sorted({p.method for p in points if p.method != "full" and not p.method.startswith("kvpress:")})
    best = sorted(ours, key=lambda m: -(mean_score(points, m, None) or 0.0))[:top]
    papers = {paper_of(m) for m in best}
    rivals = sorted({p.method for p in points if p.method.startswith("kvpress:")})
    return best + [r for r in rivals if paper_of(r) in papers or paper_of(r) == r]


MARKERS = ("o", "s", "^", "D", "v", "P")  # kvstack lines of one paper, in turn (`auto` and `auto(bits=...)`)
LINES = ("-", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 1)))


def line_styles(methods: list[str]) -> dict[str, dict[str, Any]]:
    """One colour per paper: kvstack's line solid with dots, kvpress's counterpart dashed with
    crosses; a paper's other kvstack lines (other settings) each with their own marker and dashes."""
    from matplotlib import colormaps

    papers = dict.fromkeys(paper_of(m) for m in methods)
    palette = colormaps["tab10" if len(papers) <= 10 else "tab20"].colors
    colours: dict[str, Any] = {}
    drawn: dict[str, int] = {}  # kvstack lines of each paper so far
    styles = {}
    for method in methods:
        paper = paper_of(method)
        colour = colours.setdefault(paper, palette[len(colours) % len(palette)])
        if method.startswith("kvpress:"):
            styles[method] = {"color": colour, "marker": "x", "linestyle": "--"}
            continue
        k = drawn[paper] = drawn.get(paper, -1) + 1
        styles[method] = {"color": colour, "marker": MARKERS[k % len(MARKERS)], "linestyle": LINES[k % len(LINES)]}
    return styles


MEAN = "mean over answer tasks"


def answer_tasks(points: list[Point]) -> list[str]:
    """Tasks scored by answers; `fidelity` (agreement with the full cache, another scale) is shown apart."""
    tasks = sorted({p.task for p in points})
    return [t for t in tasks if t != "fidelity"] or tasks


def mean_score(points: list[Point], method: str, budget: str | None, task: str = MEAN) -> float | None:
    """Mean score of `method` at `budget` (any budget if None) on `task`, or over the answer tasks."""
    tasks = answer_tasks(points) if task == MEAN else [task]
    chosen = [
        p.score for p in points if p.method == method and (budget is None or p.budget == budget) and p.task in tasks
    ]
    return statistics.fmean(chosen) if chosen else None


def cost_of(points: list[Point], method: str, budget: str, tasks: list[str]) -> tuple[str, str, str, str]:
    """(KV ratio, prefill s, compress s, decode tok/s) of `method` at `budget` over `tasks`, as table
    cells: the mean ratio measured, medians of the per-task medians, `-` where none was measured."""
    cell = [p for p in points if p.method == method and p.budget == budget and p.task in tasks]
    return (
        _shown(_mean(p.kv_ratio for p in cell), ".3f"),
        _shown(_median(p.prefill_s for p in cell), ".2f"),
        _shown(_median(p.compress_s for p in cell), ".2f"),
        _shown(_median(p.decode_tokens_per_s for p in cell), ".1f"),
    )


def score_table(points: list[Point]) -> str:
    """HTML: per task and over the answer tasks, mean score per method x budget; best per column in bold."""
    budgets = budgets_of(points)
    methods = sorted({p.method for p in points if p.method != "full"})
    parts = []
    for task in [*sorted({p.task for p in points}), MEAN]:
        ref = mean_score(points, "full", None, task)
        head = "".join(f"<th>{html.escape(b)}</th>" for b in budgets)
        rows = [f"<tr><td>full cache</td><td colspan={len(budgets)}>{_fmt(ref)}</td></tr>"]
        values = {(m, b): mean_score(points, m, b, task) for m in methods for b in budgets}
        best = {b: max((v for m in methods if (v := values[(m, b)]) is not None), default=None) for b in budgets}
        for m in methods:
            cells = []
            for b in budgets:
                v = values[(m, b)]
                text = _fmt(v) + (f" <small>({v / ref:.0%})</small>" if v is not None and ref else "")
                cells.append(f"<td><b>{text}</b></td>" if v is not None and v == best[b] else f"<td>{text}</td>")
            rows.append(f"<tr><td>{html.escape(m)}</td>{''.join(cells)}</tr>")
        parts.append(
            f"<div><h3>{html.escape(task)}</h3><table><tr><th>method \\ budget</th>{head}</tr>"
            f"{''.join(rows)}</table></div>"
        )
    return f"<div class='tables'>{''.join(parts)}</div>"


@dataclass(frozen=True)
class Standing:
    """One line of a leaderboard: a kvstack method's mean score at a budget and its kvpress counterpart's."""

    method: str
    score: float
    compress_share: float  # compression time / prefill time, means over the answer tasks
    rival: str | None
    rival_score: float | None
    rival_compress_share: float | None


def leaderboard(points: list[Point], budget: str, top: int = 5) -> list[Standing]:
    """The `top` kvstack methods by mean score over the answer tasks at `budget`, best first (ties by
    name), each with its kvpress counterpart (same paper) where the sweep ran one."""
    tasks = answer_tasks(points)
    methods = {p.method for p in points}
    rivals = {kvstack_method(r, methods): r for r in methods if r.startswith("kvpress:")}

    def share(method: str) -> float | None:
        cell = [p for p in points if p.method == method and p.budget == budget and p.task in tasks]
        return _mean(p.compress_s for p in cell) / _mean(p.prefill_s for p in cell) if cell else None

    ours = [m for m in methods if m != "full" and not m.startswith("kvpress:")]
    ranked = sorted(
        ((score, m) for m in ours if (score := mean_score(points, m, budget)) is not None), key=lambda x: (-x[0], x[1])
    )
    out = []
    for score, method in ranked[:top]:
        rival = rivals.get(method)
        out.append(
            Standing(
                method,
                score,
                share(method) or 0.0,
                rival,
                mean_score(points, rival, budget) if rival else None,
                share(rival) if rival else None,
            )
        )
    return out


def leaderboard_table(points: list[Point], top: int = 10) -> str:
    """HTML: per budget, the best kvstack methods with their kvpress counterparts and compression cost."""
    parts = []
    for budget in budgets_of(points):
        board = leaderboard(points, budget, top)
        if not board:
            continue
        rows = "".join(
            f"<tr><td>{i}</td><td>{html.escape(s.method)}</td><td>{s.score:.2f}</td><td>{s.compress_share:.2f}</td>"
            f"<td>{html.escape(s.rival or '-')}</td><td>{_fmt(s.rival_score)}</td>"
            f"<td>{_fmt(s.rival_compress_share)}</td></tr>"
            for i, s in enumerate(board, 1)
        )
        parts.append(
            f"<div><h3>budget {html.escape(budget)}</h3><table><tr><th>#</th><th>method</th><th>mean score</th>"
            "<th>compress / prefill</th><th>kvpress</th><th>score</th><th>compress / prefill</th></tr>"
            f"{rows}</table></div>"
        )
    if not parts:
        return ""
    return f"<h3>leaderboard (mean over the answer tasks)</h3><div class='tables'>{''.join(parts)}</div>"


def fidelity_table(points: list[Point]) -> str:
    """HTML: teacher-forced agreement with the full cache: top-1, KL divergence and perplexity."""
    rows = [
        f"<tr><td>{html.escape(p.method)}</td><td>{html.escape(p.budget)}</td><td>{p.score:.3f}</td>"
        f"<td>{p.kl:.3f}</td><td>{p.ppl:.2f}</td></tr>"
        for p in sorted(points, key=lambda p: (p.method != "full", p.method, -float(p.budget.rstrip("t"))))
        if p.task == "fidelity"
    ]
    if not rows:
        return ""
    return (
        "<h3>fidelity (real text teacher-forced after the compressed context)</h3><table><tr><th>method</th>"
        f"<th>budget</th><th>top-1 agreement</th><th>KL(full || method)</th><th>perplexity</th></tr>{''.join(rows)}"
        "</table>"
    )


def speed_table(points: list[Point]) -> str:
    """HTML: medians of prefill, compression and decode speed, and the mean measured KV ratio."""
    by: dict[tuple[str, str], list[Point]] = defaultdict(list)
    for p in points:
        by[(p.method, p.budget)].append(p)
    rows = []
    for (method, budget), ps in sorted(by.items()):
        rows.append(
            f"<tr><td>{html.escape(method)}</td><td>{html.escape(budget)}</td>"
            f"<td>{statistics.fmean(p.kv_ratio for p in ps):.3f}</td>"
            f"<td>{_shown(_median(p.prefill_s for p in ps), '.2f')}</td>"
            f"<td>{_shown(_median(p.compress_s for p in ps), '.3f')}</td>"
            f"<td>{_shown(_median(p.decode_tokens_per_s for p in ps), '.1f')}</td>"
            f"<td>{_shown(max((p.peak_rss_mb for p in ps if not math.isnan(p.peak_rss_mb)), default=math.nan), '.0f')}"
            "</td></tr>"
        )
    return (
        "<table><tr><th>method</th><th>budget</th><th>KV ratio</th><th>prefill s</th><th>compress s</th>"
        f"<th>decode tok/s</th><th>peak RSS MB</th></tr>{''.join(rows)}</table>"
    )


def rival_table(points: list[Point]) -> str:
    """HTML: each kvstack method beside its kvpress counterpart, over the tasks both ran: score, bytes, time."""
    methods = {p.method for p in points}
    pairs = sorted((ours, r) for r in methods if r.startswith("kvpress:") and (ours := kvstack_method(r, methods)))
    rows = []
    for ours, theirs in pairs:
        for budget in budgets_of(points):
            a = {p.task: p for p in points if p.method == ours and p.budget == budget}
            b = {p.task: p for p in points if p.method == theirs and p.budget == budget}
            tasks = sorted(a.keys() & b.keys())
            if not tasks:
                continue

            def mean(side: dict[str, Point], attr: str, tasks: list[str] = tasks) -> float:
                return statistics.fmean(getattr(side[t], attr) for t in tasks)

            cells = [
                f"{mean(a, 'score'):.2f} / {mean(b, 'score'):.2f}",
                f"{mean(a, 'kv_ratio'):.3f} / {mean(b, 'kv_ratio'):.3f}",
                f"{mean(a, 'compress_s'):.3f} / {mean(b, 'compress_s'):.3f}",
                f"{mean(a, 'decode_tokens_per_s'):.1f} / {mean(b, 'decode_tokens_per_s'):.1f}",
            ]
            rows.append(
                f"<tr><td>{html.escape(ours)} / {html.escape(theirs)}</td><td>{html.escape(budget)}</td>"
                f"<td>{len(tasks)}</td>{''.join(f'<td>{c}</td>' for c in cells)}</tr>"
            )
    if not rows:
        return ""
    return (
        "<h3>kvstack / kvpress, same paper</h3><table><tr><th>method</th><th>budget</th><th>tasks</th>"
        "<th>score</th><th>KV ratio</th><th>compress s</th><th>decode tok/s</th></tr>"
        f"{''.join(rows)}</table><p><small>kvpress compresses once after the prefill and lets the cache grow while "
        "decoding; kvstack holds the budget at every step. Means over the tasks both ran.</small></p>"
    )


def load_groups(out_dir: Path) -> dict[Group, list[Point]]:
    """The aggregated results of a benchmark folder, or a one-line error saying how to get them."""
    return aggregate(read_rows(out_dir))


def write_report(out_dir: Path, groups: dict[Group, list[Point]] | None = None) -> Path:
    """Write `report.html` and one PNG per group of `out_dir`'s results; return the HTML path."""
    groups = load_groups(out_dir) if groups is None else groups
    sections = []
    for i, (group, points) in enumerate(sorted(groups.items())):
        png = out_dir / f"score_vs_kv_{i}.png"
        plot_group(group, points, png)
        model, mode, length = group
        n = min(p.n for p in points)
        sections.append(
            f"<h2>{html.escape(model)} - {tokens_label(length)} - {mode_label(mode)} ({n}+ samples per cell)</h2>"
            f'<img src="{png.name}" alt="score vs KV ratio">'
            f"{leaderboard_table(points)}{score_table(points)}{rival_table(points)}{fidelity_table(points)}"
            f"<h3>speed</h3>{speed_table(points)}"
        )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvstack report</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child{text-align:left}"
        "img{max-width:100%}.tables{display:flex;flex-wrap:wrap;gap:0 2em}</style></head><body>"
        "<h1>kvstack benchmark</h1>"
        "<p>Scores are RULER string match (share of reference strings in the answer); for <i>fidelity</i> the "
        "score is top-1 agreement with the full cache while teacher-forcing real text. KV ratio is measured "
        "from the cache's tensors after the prompt; percentages are relative to the full cache.</p>"
        + "".join(sections)
        + "</body></html>"
    )
    report = out_dir / "report.html"
    report.write_text(page)
    return report


def mode_label(mode: str) -> str:
    """`query-agnostic`, `query-aware`, or for the reuse task's joins `documents joined (kvlink)`."""
    return f"query-{mode}" if mode in ("agnostic", "aware") else f"documents joined ({mode})"


def tokens_label(length: int) -> str:
    """`2048 tokens`, or `contexts of their own length` for task-file cells (length 0)."""
    return f"{length} tokens" if length else "contexts of their own length"


def _shown(value: float, spec: str) -> str:
    """A number for a table cell, `-` where nothing was measured."""
    return "-" if math.isnan(value) else format(value, spec)


def _mean(values: Iterable[float | None]) -> float:
    known = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(known) if known else math.nan


def _median(values: Iterable[float | None]) -> float:
    """Median of the measured values (fidelity rows have no prefill or decode: None, or NaN once
    aggregated), NaN when there are none."""
    known = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(known) if known else float("nan")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
