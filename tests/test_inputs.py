"""Every input the hardening issue lists: a one-line error naming the fix, before any work starts."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstack.bench.store import read_rows
from kvstack.bench.tasks.custom import load_task_file
from kvstack.cache.budget import Budget
from kvstack.cli import app
from kvstack.errors import UserError
from kvstack.stack import Stack


@pytest.mark.parametrize(
    "spec,message",
    [
        ("knorm+int(bits=2.0)", "int: bits must be an integer, got 2.0"),
        ("knorm(every=1e400)", "knorm: every must be an integer or None, got inf"),
        ("knorm(every=1.5)", "knorm: every must be an integer or None, got 1.5"),
        ("snapkv(window_size='abc')", "snapkv: window_size must be an integer, got 'abc'"),
        ("snapkv(every=2**64)", "snapkv: cannot read every=2\\*\\*64: write a number"),
        ("snapkv(every=18446744073709551616)", "every=18446744073709551616 is out of range: give an integer from 1"),
        ("d2o(recall='abc')", "d2o: recall must be True or False, got 'abc'"),
        ("d2o(recall=None)", "d2o: recall must be True or False, got None"),
        ("plan:", "plan: needs a path"),
        ("plan:/", "plan / is a directory"),
        ("plan:" + "a" * 300, "cannot read plan file a+\\.\\.\\. \\(OSError\\)"),
        ("pyramid(" * 991 + "snapkv" + ")" * 991, "method spec of 8925 characters"),
        ("pyramid(" * 9 + "snapkv" + ")" * 9, "nests stages more than 8 deep"),
        ("snapkv(window_size=" + "-" * 1500 + "1)", "cannot read window_size="),
        ("snapkv(window_size='4)", "unclosed quote '"),
        ("snapkv(window_size=4))", "unbalanced '\\)'"),
        ("cq(samples=100000)", "cq: samples=100000 is out of range: give an integer from 1 to 256"),
        ("snapkv(window_size=4, window_size=8)", "window_size is given twice"),
    ],
)
def test_bad_specs_are_one_line_errors(spec: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as err:
        Stack.parse(spec)
    assert "\n" not in str(err.value)


def test_quotes_strings_tuples_and_a_trailing_comma_parse() -> None:
    assert Stack.parse("auto(scorers='kvzip')").stages[0].scorers == ("kvzip",)  # not 'k', 'v', 'z', ...
    assert Stack.parse("auto(scorers=('kvzip', 'snapkv'), residuals=[0, 32])").stages[0].residuals == (0, 32)
    assert Stack.parse("snapkv(window_size=4,)") == Stack.parse("snapkv(window_size=4)")
    with pytest.raises(UserError, match="plan file a,b.json does not exist"):  # the comma is inside the quotes
        Stack.parse("plan:'a,b.json'")
    with pytest.raises(UserError, match="kvcrush: anchor must be one of"):  # the ')' is inside the quotes
        Stack.parse("kvcrush(anchor='a)b')")


@pytest.mark.parametrize(
    "text,message",
    [
        ("1e-30", "budget 1e-30 is out of range: a fraction must be in \\[0.0001, 1\\]"),
        ("9" * 309 + "MB", "is out of range: give a size up to 1024TB"),
        ("0t", "keep 1 to 2147483647 tokens per head"),
        ("nan", "out of range"),
        ("1/8", "not understood"),
    ],
)
def test_bad_budgets_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        Budget.parse(text)


def test_budget_labels_keep_every_digit() -> None:
    assert str(Budget.parse("0.9999999")) == "0.9999999" and str(Budget.parse("1")) == "1"
    assert str(Budget.parse("0.125")) == "0.125" and str(Budget.parse("64MB")) == "64MB"
    assert Budget.parse(str(Budget.parse("0.33333333"))) != Budget.parse("0.3333333")  # distinct store keys


def store_with(folder: Path, *rows: tuple) -> Path:
    db = sqlite3.connect(folder / "results.sqlite")
    db.execute(
        "CREATE TABLE results (model, method, budget, mode, task, length, sample, question, score, answer, refs)"
    )
    db.executemany("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()
    return folder


GOOD = ("m", "snapkv", "0.5", "agnostic", "niah", 100, 0, 0, 1.0, "x", '["x"]')


@pytest.mark.parametrize(
    "bad,why",
    [
        (GOOD[:8] + (None,) + GOOD[9:], "row 2: score is None, not a number"),
        (GOOD[:8] + ("high",) + GOOD[9:], "row 2: score is 'high', not a number"),
        (GOOD[:10] + (None,), "row 2: refs is 'None', not a JSON list"),
        (GOOD[:10] + ("not json",), "row 2: refs is 'not json', not a JSON list"),
    ],
)
def test_a_bad_store_row_is_skipped_with_one_line(tmp_path: Path, bad: tuple, why: str) -> None:
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    rows = read_rows(store_with(tmp_path, GOOD, bad), Console(file=out, width=400))
    assert len(rows) == 1 and rows[0]["refs"] == ["x"]
    assert why in out.getvalue() and out.getvalue().count("\n") == 1


def test_report_and_compare_render_the_good_rows_of_a_damaged_store(tmp_path: Path) -> None:
    store_with(tmp_path, GOOD, GOOD[:6] + (1, 0, None) + GOOD[9:])
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.html").exists()
    assert "row 2: score is None" in result.output


@pytest.mark.parametrize(
    "line,message",
    [
        ({"context": 7, "question": "q", "answer": "a"}, ":1: context must be a non-empty string"),
        ({"context": "   ", "question": "q", "answer": "a"}, ":1: context must be a non-empty string"),
        ({"context": "c", "question": 7, "answer": "a"}, ":1: question must be a non-empty string"),
        ({"context": "c", "question": "q", "answer": "a", "max_new_tokens": True}, ":1: max_new_tokens must be"),
        ({"context": "c", "question": "q", "answer": "a", "answer_prefix": 3}, ":1: answer_prefix must be a string"),
    ],
)
def test_task_file_fields_are_typed(tmp_path: Path, line: dict, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(UserError, match=message):
        load_task_file(path)


def test_task_files_accept_a_bom_and_name_the_line_of_bad_bytes(tmp_path: Path) -> None:
    row = json.dumps({"context": "c", "question": "q", "answer": "a"}).encode()
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + row + b"\n")
    assert load_task_file(path)[0].context == "c"
    path.write_bytes(row + b"\n" + row[:5] + b"\xff\xfe" + row[5:] + b"\n")
    with pytest.raises(UserError, match=r"t.jsonl:2: byte 6 is not UTF-8"):
        load_task_file(path)


def test_the_cli_answers_bad_input_with_one_line_and_exit_code_2(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("some context")
    for args in (
        ["--method", "knorm+int(bits=2.0)", "--budget", "0.5"],
        ["--method", "snapkv", "--budget", "1e-30"],
        ["--method", "plan:/", "--budget", "0.5"],
    ):
        result = CliRunner().invoke(app, ["generate", "-c", str(tmp_path / "c.txt"), "-q", "what?", *args])
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output and result.output.count("error:") == 1
