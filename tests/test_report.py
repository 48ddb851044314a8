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
    assert "decode tok/s" in text and "<td>900</td>" in text  # peak RSS, MB


def test_report_without_results_says_how_to_get_them(tmp_path):
    with pytest.raises(UserError, match="run `kvstack bench"):
        write_report(tmp_path)


def chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page, out):
    """Render `page` in headless Chromium (flags keep it off the network); return the pixels (h, w, rgba)."""
    import subprocess
    import tempfile

    from matplotlib.image import imread

    with tempfile.TemporaryDirectory() as profile:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
        flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
        flags += [f"--user-data-dir={profile}", f"--screenshot={out}", "--window-size=1280,2000"]
        subprocess.run([chromium(), *flags, page.as_uri()], capture_output=True, timeout=120, check=True)
    return imread(out)


@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium: `make test` installs it (apt-get)")
def test_the_report_renders_its_plots_in_a_real_browser(tmp_path):
    import numpy as np

    fill(tmp_path / "results.sqlite")
    page = write_report(tmp_path)
    pixels = screenshot(page, tmp_path / "shot.png")[..., :3]

    def plotted(pixels) -> int:
        """Pixels of matplotlib's first two line colours (blue, orange): only the plot draws them."""
        blue = np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255).max(-1) < 0.08
        orange = np.abs(pixels - np.array([0xFF, 0x7F, 0x0E]) / 255).max(-1) < 0.08
        return int(blue.sum()), int(orange.sum())

    assert pixels.shape[:2] == (2000, 1280) and pixels.std() > 0.05  # not blank
    assert min(plotted(pixels)) > 200  # both methods' lines are on screen
    (tmp_path / "score_vs_kv_0.png").unlink()  # the same page without its plot: the check sees it
    assert max(plotted(screenshot(page, tmp_path / "broken.png")[..., :3])) < 50


def test_rivals_share_their_papers_colour_and_sit_beside_it(tmp_path):
    from kvstack.bench.report import kvstack_method, line_styles

    fill(tmp_path / "results.sqlite")
    store = Store(tmp_path / "results.sqlite")
    for task, score in (("niah_single", 0.5), ("qa", 1.0)):  # qa: kvpress only, left out of the comparison
        cell = Cell("smollm2-135m", "kvpress:snapkv", "0.5", "agnostic", task, 2048)
        store.add(Row(cell, 0, 0, score, "x", ("x",), None, 120, 200, 0.6, 1.0, 0.02, 20.0, 900.0))
    store.close()
    text = write_report(tmp_path).read_text()
    # snapkv at 0.5 on niah_single: samples 1.0 and 0.5 -> 0.75; kvpress 0.5 (qa not compared)
    assert "<td>snapkv / kvpress:snapkv</td><td>0.5</td><td>1</td><td>0.75 / 0.50</td><td>0.500 / 0.600</td>" in text
    assert "kvpress:knorm" not in text
    assert (
        kvstack_method("kvpress:streaming_llm") == "streaming" and kvstack_method("kvpress:expected_attention") is None
    )
    styles = line_styles(["knorm", "snapkv", "kvpress:snapkv", "kvpress:expected_attention"])
    assert styles["kvpress:snapkv"]["color"] == styles["snapkv"]["color"] != styles["knorm"]["color"]
    assert styles["kvpress:snapkv"]["linestyle"] == "--" and styles["snapkv"]["linestyle"] == "-"
    assert styles["kvpress:expected_attention"]["color"] not in (styles["snapkv"]["color"], styles["knorm"]["color"])
    # a stack is its own line, apart from its scorer's (kvpress:kvzip pairs with kvzip alone)
    stacks = line_styles(["kvzip", "kvzip+kivi", "kvzip+kivi(residual=32)", "kvpress:kvzip"])
    assert len({stacks[m]["color"] for m in ("kvzip", "kvzip+kivi", "kvzip+kivi(residual=32)")}) == 3
    assert stacks["kvpress:kvzip"]["color"] == stacks["kvzip"]["color"]
    # two settings of one paper share its colour, each with its own marker and dashes
    autos = line_styles(["auto", "auto(bits=('16', 't4'))", "kvpress:snapkv"])
    assert autos["auto"]["color"] == autos["auto(bits=('16', 't4'))"]["color"]
    assert autos["auto"]["marker"] != autos["auto(bits=('16', 't4'))"]["marker"]
    assert autos["auto"]["linestyle"] == "-" != autos["auto(bits=('16', 't4'))"]["linestyle"]


def test_fidelity_is_reported_apart_from_the_mean_over_answer_tasks(tmp_path):
    from kvstack.bench.report import MEAN, answer_tasks, load_groups, mean_score

    fill(tmp_path / "results.sqlite")
    store = Store(tmp_path / "results.sqlite")
    for method, budget, top1, kl in [("full", "1", 1.0, 0.0), ("snapkv", "0.5", 0.9, 0.05)]:
        cell = Cell("smollm2-135m", method, budget, "agnostic", "fidelity", 2048)
        store.add(Row(cell, 0, 0, top1, "", (), None, 100, 200, 0.5, None, 0.1, None, 900.0, kl, 12.5))
    store.close()
    (points,) = load_groups(tmp_path).values()
    assert answer_tasks(points) == ["niah_single", "vt"]
    assert mean_score(points, "snapkv", "0.5") == pytest.approx(0.75)  # fidelity's 0.9 is not averaged in
    assert mean_score(points, "snapkv", "0.5", "fidelity") == pytest.approx(0.9)
    text = write_report(tmp_path).read_text()
    assert MEAN in text and "<td>snapkv</td><td>0.5</td><td>0.900</td><td>0.050</td><td>12.50</td>" in text


def test_the_speed_table_reads_the_answer_tasks_timings_beside_fidelitys_none():
    from kvstack.bench.report import Point, speed_table

    nan = float("nan")
    points = [
        Point("snapkv", "0.5", "niah_single", 1.0, 0.5, 8, 1.25, 0.1, 30.0),
        Point("snapkv", "0.5", "fidelity", 0.9, 0.5, 8, nan, 0.1, nan),
    ]
    table = speed_table(points)
    assert "nan" not in table and "<td>1.25</td>" in table and "<td>30.0</td>" in table


def test_a_crowded_plot_draws_the_best_methods_and_their_rivals_only():
    from kvstack.bench.report import Point, kvstack_method, line_styles, plotted

    def point(method, score):
        return Point(method, "0.25", "niah_single", score, 0.25, 1, 1.0, 0.1, 10.0)

    scores = {"adakv(snapkv)": 0.9, "snapkv": 0.8, "knorm": 0.2, "tova": 0.1, "streaming": 0.7}
    rivals = {"kvpress:adakv": 0.5, "kvpress:knorm": 0.3, "kvpress:snapkv": 0.6, "kvpress:expected_attention": 0.4}
    points = [point(m, s) for m, s in {**scores, **rivals, "full": 1.0}.items()]
    assert plotted(points, top=2) == [
        "adakv(snapkv)",
        "snapkv",
        "kvpress:adakv",
        "kvpress:expected_attention",
        "kvpress:snapkv",
    ]
    assert (
        kvstack_method("kvpress:adakv", scores) == "adakv(snapkv)"
        and kvstack_method("kvpress:adakv", ["adakv"]) is None
    )
    styles = line_styles(["adakv(snapkv)", "kvpress:adakv"])
    assert styles["adakv(snapkv)"]["color"] == styles["kvpress:adakv"]["color"]  # one paper, one colour


def test_the_leaderboard_ranks_by_mean_score_beside_the_kvpress_counterpart():
    from kvstack.bench.report import Point, leaderboard

    def point(method, task, score, compress, prefill=2.0):
        return Point(method, "0.125", task, score, 0.13, 1, prefill, compress, 10.0)

    points = [
        point("snapkv", "niah_single", 1.0, 0.5),
        point("snapkv", "qa", 0.0, 0.3),  # mean 0.5, compress 0.4 / prefill 2 = 0.2
        point("knorm", "niah_single", 0.5, 0.1),
        point("knorm", "qa", 0.7, 0.1),  # mean 0.6
        point("kvpress:snapkv", "niah_single", 0.25, 1.0, prefill=1.0),
        point("kvpress:snapkv", "qa", 0.25, 1.0, prefill=1.0),
        point("full", "niah_single", 1.0, 0.0),
        point("snapkv", "fidelity", 0.99, 0.0),  # not an answer task: never in the mean
    ]
    board = leaderboard(points, "0.125", top=5)
    assert [(s.method, round(s.score, 2)) for s in board] == [("knorm", 0.6), ("snapkv", 0.5)]
    assert board[1].rival == "kvpress:snapkv" and board[1].rival_score == 0.25 and board[1].rival_compress_share == 1.0
    assert board[1].compress_share == pytest.approx(0.2) and board[0].rival is None
