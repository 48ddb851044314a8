"""The report from a small synthetic results file: a page with plots and tables."""

import pytest

from kvstack.bench.report import aggregate, budgets_of, write_report
from kvstack.bench.store import Cell, Row, Store
from kvstack.errors import UserError


def fill(path):
    store = Store(path)
    for task in ("niah_single", "vt"):
        for method, budget, score, ratio in [
            ("full", "1", 1.0, 1.0),
            ("snapkv", "0.5", 1.0, 0.5),
            ("snapkv", "0.25", 0.5, 0.25),
            ("knorm", "0.5", 0.5, 0.5),
            ("knorm", "0.25", 0.0, 0.25),
        ]:
            for sample in range(2):
                cell = Cell("smollm2-135m", method, budget, "agnostic", task, 2048)
                store.add(
                    Row(
                        cell,
                        sample,
                        0,
                        score if sample == 0 else score / 2,
                        "x",
                        ("x",),
                        None,
                        100,
                        200,
                        ratio,
                        1.0,
                        0.1,
                        12.0,
                        900.0,
                    )
                )
    store.close()


def test_aggregate_means_and_budget_order(tmp_path):
    fill(tmp_path / "results.sqlite")
    groups = aggregate(Store(tmp_path / "results.sqlite").rows())
    (points,) = groups.values()
    snap = [p for p in points if p.method == "snapkv" and p.budget == "0.25" and p.task == "vt"][0]
    assert snap.score == pytest.approx(0.375) and snap.n == 2
    assert budgets_of(points) == ["0.5", "0.25"]


def test_report_writes_a_page_with_its_plot_and_marks_the_best(tmp_path):
    fill(tmp_path / "results.sqlite")
    page = write_report(tmp_path)
    text = page.read_text()
    png = tmp_path / "score_vs_kv_0.png"
    assert png.exists() and png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert 'src="score_vs_kv_0.png"' in text
    assert "<b>0.75 <small>(100%)</small></b>" in text  # snapkv at 0.5 matches the full cache: best, bold
    assert "decode tok/s" in text


def test_report_without_results_says_how_to_get_them(tmp_path):
    with pytest.raises(UserError, match="run `kvstack bench"):
        write_report(tmp_path)
