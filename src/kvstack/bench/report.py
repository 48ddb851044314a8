"""Turn a results store into tables and plots a person reads at a glance: report.html + PNGs.

Per (model, mode, length): score vs measured KV ratio, one line per method and the full cache
as a dashed reference, one panel per task; a table of mean score per budget with the best
of each column in bold (and relative to the full cache); a speed table.
"""

from __future__ import annotations

import html
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.bench.store import Store

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
                kv_ratio=statistics.fmean(r["kv_ratio"] for r in rs),
                n=len(rs),
                prefill_s=_median(r["prefill_s"] for r in rs),
                compress_s=_median(r["compress_s"] for r in rs),
                decode_tokens_per_s=_median(r["decode_tokens_per_s"] for r in rs),
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
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    methods = sorted({p.method for p in points if p.method != "full"})
    for ax, task in zip(axes[0], tasks, strict=True):
        for p in points:
            if p.task == task and p.method == "full":
                ax.axhline(p.score, color="black", linestyle="--", linewidth=1, label="full cache")
        for method in methods:
            line = sorted((p.kv_ratio, p.score) for p in points if p.task == task and p.method == method)
            if line:
                ax.plot(*zip(*line, strict=True), marker="o", label=method)
        ax.set_title(task)
        ax.set_xlabel("KV bytes held / full (measured)")
        ax.set_xscale("log", base=2)
        lo = min(p.kv_ratio for p in points) / 1.4
        ax.set_xticks([2.0**-k for k in range(12) if 2.0**-k >= lo])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlim(lo, 1.15)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("score")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    model, mode, length = group
    fig.suptitle(f"{model} - {tokens_label(length)} - query-{mode}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def score_table(points: list[Point]) -> str:
    """HTML: per task (and the mean over tasks), mean score per method x budget; best per column in bold."""
    budgets = budgets_of(points)
    tasks = sorted({p.task for p in points})
    full = {p.task: p.score for p in points if p.method == "full"}
    methods = sorted({p.method for p in points if p.method != "full"})
    parts = []
    for task in [*tasks, "mean over tasks"]:

        def value(method: str, budget: str, task: str = task) -> float | None:
            chosen = [
                p.score
                for p in points
                if p.method == method and p.budget == budget and (p.task == task or task == "mean over tasks")
            ]
            return statistics.fmean(chosen) if chosen else None

        ref = statistics.fmean(full.values()) if task == "mean over tasks" and full else full.get(task)
        head = "".join(f"<th>{html.escape(b)}</th>" for b in budgets)
        rows = [f"<tr><td>full cache</td><td colspan={len(budgets)}>{_fmt(ref)}</td></tr>"]
        best = {b: max((v for m in methods if (v := value(m, b)) is not None), default=None) for b in budgets}
        for m in methods:
            cells = []
            for b in budgets:
                v = value(m, b)
                text = _fmt(v) + (f" <small>({v / ref:.0%})</small>" if v is not None and ref else "")
                cells.append(f"<td><b>{text}</b></td>" if v is not None and v == best[b] else f"<td>{text}</td>")
            rows.append(f"<tr><td>{html.escape(m)}</td>{''.join(cells)}</tr>")
        parts.append(
            f"<h3>{html.escape(task)}</h3><table><tr><th>method \\ budget</th>{head}</tr>{''.join(rows)}</table>"
        )
    return "\n".join(parts)


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
            f"<td>{_median(p.prefill_s for p in ps):.2f}</td>"
            f"<td>{_median(p.compress_s for p in ps):.3f}</td>"
            f"<td>{_median(p.decode_tokens_per_s for p in ps):.1f}</td></tr>"
        )
    return (
        "<table><tr><th>method</th><th>budget</th><th>KV ratio</th><th>prefill s</th><th>compress s</th>"
        f"<th>decode tok/s</th></tr>{''.join(rows)}</table>"
    )


def load_groups(out_dir: Path) -> dict[Group, list[Point]]:
    """The aggregated results of a benchmark folder, or a one-line error saying how to get them."""
    path = out_dir / "results.sqlite"
    if not path.exists():
        from kvstack.errors import UserError

        raise UserError(f"no results in {out_dir}: run `kvstack bench --out {out_dir}` first")
    store = Store(path)
    groups = aggregate(store.rows())
    store.close()
    return groups


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
            f"<h2>{html.escape(model)} - {tokens_label(length)} - query-{mode} ({n}+ samples per cell)</h2>"
            f'<img src="{png.name}" alt="score vs KV ratio">'
            f"{score_table(points)}<h3>speed</h3>{speed_table(points)}"
        )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvstack report</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child{text-align:left}"
        "img{max-width:100%}</style></head><body><h1>kvstack benchmark</h1>"
        "<p>Scores are RULER string match (share of reference strings in the answer); for <i>fidelity</i> the "
        "score is top-1 agreement with the full cache while teacher-forcing real text. KV ratio is measured "
        "from the cache's tensors after the prompt; percentages are relative to the full cache.</p>"
        + "".join(sections)
        + "</body></html>"
    )
    report = out_dir / "report.html"
    report.write_text(page)
    return report


def tokens_label(length: int) -> str:
    """`2048 tokens`, or `contexts of their own length` for task-file cells (length 0)."""
    return f"{length} tokens" if length else "contexts of their own length"


def _median(values: Iterable[float | None]) -> float:
    """Median of the measured values (fidelity rows have no decode), NaN when there are none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else float("nan")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
