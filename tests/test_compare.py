"""`kvstack compare`: a stack against the best other at each budget, paired on the same
questions, with a bootstrap interval that says when a sweep cannot tell them apart."""

import pytest
from typer.testing import CliRunner

from kvstack.bench.compare import compare, interval, paired, task_mean
from kvstack.bench.store import Cell, Row, Store
from kvstack.cli import app


def rows(method, budget, task, scores, ratio=None):
    return [
        {
            "model": "m",
            "mode": "agnostic",
            "length": 2048,
            "method": method,
            "budget": budget,
            "task": task,
            "sample": i,
            "question": 0,
            "score": s,
            "kv_ratio": ratio,
        }
        for i, s in enumerate(scores)
    ]


def stored(path, scores_by_method):
    """A results store at `path` with one niah_single answer per score, per method (open)."""
    store = Store(path / "results.sqlite")
    for method, scores in scores_by_method.items():
        for i, s in enumerate(scores):
            store.add(Row(Cell("m", method, "0.125", "agnostic", "niah_single", 2048), i, 0, s, "", ()))
    return store


def test_pairs_are_the_questions_both_answered_and_means_are_per_task_first():
    scores = {
        ("a", "qa"): {(0, 0): 1.0, (1, 0): 0.0, (2, 0): 1.0},
        ("b", "qa"): {(0, 0): 0.0, (2, 0): 0.0},
        ("a", "x"): {},
    }
    pairs = paired(scores, "a", "b", ["qa"])
    assert pairs == {"qa": [(1.0, 0.0), (1.0, 0.0)]}  # sample 1: b has no answer
    two = {"qa": [(1.0, 0.0), (0.0, 0.0)], "fidelity": [(0.5, 0.25)]}
    assert task_mean(two, 0) == pytest.approx((0.5 + 0.5) / 2)  # qa 0.5, fidelity 0.5
    assert task_mean(two, 1) == pytest.approx((0.0 + 0.25) / 2)


def test_the_interval_of_a_constant_difference_is_that_difference_and_widens_with_noise():
    same = {"qa": [(1.0, 0.75)] * 10}
    assert interval(same) == pytest.approx((0.25, 0.25))
    noisy = {"qa": [(1.0, 0.0)] * 5 + [(0.0, 1.0)] * 5}
    low, high = interval(noisy)
    assert low < 0 < high  # five wins and five losses: no verdict


def test_compare_takes_the_best_rival_that_fits_the_budget():
    data = (
        rows("auto", "0.25", "qa", [1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
        + rows("auto", "0.25", "fidelity", [0.8] * 10, ratio=0.24)
        + rows("good", "0.25", "qa", [1, 1, 1, 1, 1, 0, 0, 0, 0, 0])  # the best that fits
        + rows("good", "0.25", "fidelity", [0.8] * 10, ratio=0.25)
        + rows("weak", "0.25", "qa", [0] * 10)
        + rows("weak", "0.25", "fidelity", [0.5] * 10, ratio=0.2)
        + rows("fat", "0.25", "qa", [1] * 10)  # holds more than the budget
        + rows("fat", "0.25", "fidelity", [1.0] * 10, ratio=0.3)
        + rows("half", "0.25", "qa", [1] * 10)  # ran one task of two (refused the other)
        + rows("auto(validate=0)", "0.25", "qa", [1] * 10)  # the method itself, other settings
        + rows("auto(validate=0)", "0.25", "fidelity", [1.0] * 10, ratio=0.2)
        + rows("full", "1", "qa", [1] * 10)
    )
    (c,) = compare(data, "auto")
    assert (c.budget, c.rival, c.tasks, c.pairs) == ("0.25", "good", ("fidelity", "qa"), 20)
    assert c.score == pytest.approx((0.4 + 0.8) / 2) and c.rival_score == pytest.approx((0.5 + 0.8) / 2)
    assert c.low < c.difference < c.high and c.verdict == "cannot tell"  # one question of ten
    (over,) = compare(data, "auto", within=False)
    assert over.rival == "fat" and over.verdict == "worse"  # every qa answer lost, fidelity lower


def test_the_command_prints_the_comparison_and_names_an_unknown_method(tmp_path):
    stored(tmp_path, {"auto": [1.0] * 6, "kvzip": [0.0] * 6}).close()
    result = CliRunner().invoke(app, ["compare", str(tmp_path)], terminal_width=160)
    assert result.exit_code == 0, result.stderr
    assert "kvzip" in result.stdout and "+1.000" in result.stdout and "better" in result.stdout
    assert "best on the other half of the samples" in " ".join(result.stdout.split())  # the held-out table
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "--method", "autp"])
    assert result.exit_code == 2 and "did you mean auto" in result.stderr and "Traceback" not in result.stderr
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "run `kvstack bench" in result.stderr


def test_an_empty_sweep_says_how_to_fill_it(tmp_path):
    Store(tmp_path / "results.sqlite").close()
    result = CliRunner().invoke(app, ["compare", str(tmp_path)])
    assert result.exit_code == 2 and "holds no answers yet" in result.stderr and "kvstack bench" in result.stderr


def test_held_out_the_rival_of_each_half_is_chosen_on_the_other_half():
    data = (
        rows("auto", "0.25", "qa", [1, 0, 1, 0])
        + rows("a", "0.25", "qa", [1, 1, 0, 0])  # even samples 0.5, odd 0.5
        + rows("b", "0.25", "qa", [0, 1, 1, 1])  # even 0.5, odd 1.0: best on the same rows (0.75)
    )
    (same,) = compare(data, "auto")
    assert (same.rival, same.rival_score) == ("b", 0.75)
    (fair,) = compare(data, "auto", held_out=True)
    # even samples meet b (best on the odd ones: 1.0 > 0.5): its 0 and 1; odd samples meet a
    # (the even ones tie at 0.5, the first name wins): its 1 and 0
    assert (fair.rival, fair.pairs) == ("b / a", 4)
    assert fair.score == 0.5 and fair.rival_score == pytest.approx((0 + 1 + 1 + 0) / 4)


def test_held_out_a_rival_that_answered_one_half_only_is_never_chosen():
    data = rows("auto", "0.25", "qa", [1, 0]) + rows("a", "0.25", "qa", [1])  # a answered sample 0 only
    assert [c.rival for c in compare(data, "auto")] == ["a"]
    assert compare(data, "auto", held_out=True) == []  # chosen on sample 1 it cannot be; scored there, neither


def test_rows_from_two_machines_are_named_and_the_command_warns(tmp_path):
    data = rows("auto", "0.25", "qa", [1, 0]) + rows("a", "0.25", "qa", [1, 1])
    for r in data:
        r["machine"] = "cpu X, torch 2" if r["method"] == "auto" else None  # the rival's: not recorded
    (c,) = compare(data, "auto")
    assert c.machines == ("a machine not recorded", "cpu X, torch 2")
    (same,) = compare([{**r, "machine": "cpu X, torch 2"} for r in data], "auto")
    assert same.machines == ("cpu X, torch 2",)
    store = stored(tmp_path, {"auto": [1.0] * 4, "kvzip": [0.0] * 4})
    store.db.execute("UPDATE results SET machine = 'elsewhere' WHERE method = 'kvzip'")
    store.db.commit(), store.close()
    result = CliRunner().invoke(app, ["compare", str(tmp_path)], terminal_width=160)
    text = " ".join(result.stdout.split())
    assert result.exit_code == 0 and "come from 2 machines" in text and "elsewhere" in text


def test_full_caches_of_other_sizes_are_named_and_the_command_warns(tmp_path):
    """A rival in bf16 beside a float32 model: the same fraction is half the bytes."""
    data = rows("auto", "0.125", "qa", [1, 0]) + rows("a", "0.125", "qa", [1, 1])
    for r in data:
        r["kv_bytes_full"] = 4000 if r["method"] == "auto" else 2000
    (c,) = compare(data, "auto")
    assert c.full_bytes == (4000.0, 2000.0) and not c.same_bytes
    (near,) = compare([{**r, "kv_bytes_full": 2040 if r["method"] == "a" else 2000} for r in data], "auto")
    assert near.same_bytes  # a question tokenized a little differently: within 5%
    store = stored(tmp_path, {"auto": [1.0] * 4, "kvzip": [0.0] * 4})
    store.db.execute("UPDATE results SET kv_bytes = 1, kv_bytes_full = 4194304 WHERE method = 'auto'")
    store.db.execute("UPDATE results SET kv_bytes = 1, kv_bytes_full = 2097152 WHERE method = 'kvzip'")
    store.db.commit(), store.close()
    result = CliRunner().invoke(app, ["compare", str(tmp_path)], terminal_width=200)
    text = " ".join(result.stdout.split())
    assert result.exit_code == 0 and "hold 4.0 MiB against 2.0 MiB" in text and "one dtype" in text


def test_piped_into_a_file_a_row_stays_on_one_line(tmp_path):
    """Without a terminal (a log, `| less`) rich would wrap the table at 80 columns, a long stack
    name over seven lines; kvstack prints up to 160."""
    import os
    import subprocess
    import sys

    long = "adakv(kvzip)+adaquant(residual=32)"
    stored(tmp_path, {"auto": [1.0] * 4, long: [0.0] * 4}).close()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    code = "from kvstack.cli import app; app()"
    done = subprocess.run(
        [sys.executable, "-c", code, "compare", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert any(long in line and "+1.000" in line for line in done.stdout.splitlines())


def test_a_named_rival_is_met_on_the_tasks_it_ran():
    """kvpress's presses run no fidelity window: named, the rival is compared on the questions of
    the tasks both ran; unnamed, a rival that skipped a task is passed over."""
    data = (
        rows("auto", "0.125", "qa", [1] * 10)
        + rows("auto", "0.125", "fidelity", [1.0] * 10, 0.12)
        + rows("kvpress:keydiff+quanto4", "0.125", "qa", [0] * 5 + [1] * 5)
    )
    assert compare(data, "auto") == []
    (c,) = compare(data, "auto", against="kvpress:keydiff+quanto4")
    assert (c.tasks, c.pairs, c.score, c.rival_score) == (("qa",), 10, 1.0, 0.5)


def test_against_a_named_stack_quantizers_alone_compare_at_budget_one(tmp_path):
    data = (
        rows("turboquant(bits=2)", "1", "qa", [1] * 8 + [0] * 2)
        + rows("kivi(bits=2)", "1", "qa", [0] * 10)
        + rows("hadamard+kivi(bits=2)", "1", "qa", [1] * 10)  # better, but not the one named
        + rows("full", "1", "qa", [1] * 10)
    )
    assert compare(data, "turboquant(bits=2)") == []  # budget 1 is the full cache's, unless a rival is named
    (c,) = compare(data, "turboquant(bits=2)", against="kivi(bits=2)")
    assert (c.budget, c.rival, c.pairs, c.score, c.rival_score) == ("1", "kivi(bits=2)", 10, 0.8, 0.0)
    assert c.verdict == "better"
    store = Store(tmp_path / "results.sqlite")
    for r in data:
        store.add(
            Row(Cell("m", r["method"], r["budget"], "agnostic", r["task"], 2048), r["sample"], 0, r["score"], "", ())
        )
    store.close()
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "--method", "turboquant(bits=2)"])
    assert result.exit_code == 2 and "--against" in result.stderr and "Traceback" not in result.stderr
    result = CliRunner().invoke(
        app,
        ["compare", str(tmp_path), "--method", "turboquant(bits=2)", "--against", "kivi(bits=2)"],
        terminal_width=200,
    )
    assert result.exit_code == 0, result.stderr
    assert "better" in result.stdout and "+0.800" in result.stdout
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "--method", "turboquant(bits=2)", "--against", "kiv"])
    assert result.exit_code == 2 and "did you mean" in result.stderr
