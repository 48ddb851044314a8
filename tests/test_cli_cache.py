"""`kvstack cache save|load|info` as a user meets them: a file written once, answers from it equal
to `kvstack generate --query-agnostic`, and one-line errors for bad files."""

import json

import pytest
from typer.testing import CliRunner

from kvstack.cli import app

runner = CliRunner()
SPEC = "snapkv(every=4, window_size=4)"  # as the stack labels itself


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def context(tmp_path):
    path = tmp_path / "ctx.txt"
    path.write_text("Some context about ships and whales. The answer is 42. " * 3)
    return path


def test_save_info_and_load_answer_like_generate(tiny_folder, context, tmp_path):
    path = tmp_path / "ctx.kvc"
    code, out, err = run(
        "cache", "save", "-c", context, "-o", path, "-m", tiny_folder, "--method", SPEC, "--budget", 0.5
    )
    assert code == 0, err
    assert "saved" in out and path.is_file()
    code, out, _ = run("cache", "info", path, "--json")
    header = json.loads(out)
    assert code == 0 and header["stack"] == SPEC and header["budget"] == "0.5" and header["model"] == tiny_folder.name
    code, out, _ = run("cache", "info", path)
    assert code == 0 and "kv bytes" in out
    code, out, err = run("cache", "load", path, "-q", "What?", "-m", tiny_folder, "--json", "--max-new-tokens", 6)
    assert code == 0, err
    loaded = json.loads(out)
    code, out, _ = run(
        "generate", "-c", context, "-q", "What?", "-m", tiny_folder, "--method", SPEC, "--budget", 0.5,
        "--query-agnostic", "--json", "--max-new-tokens", 6,
    )  # fmt: skip
    fresh = json.loads(out)
    assert loaded["answer"] == fresh["answer"] and loaded["kv_bytes"] == fresh["kv_bytes"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "/nowhere/c.kvc"], "no cache file"),
        (["load", "/nowhere/c.kvc", "-q", "What?"], "no cache file"),
        (["save", "-c", "/nowhere.txt", "-o", "x.kvc"], "does not exist"),
        (["save", "-c", "CONTEXT", "-o", "x.kvc", "--method", "kvzp"], "did you mean kvzip"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(context, args, message):
    code, out, err = run("cache", *[str(context) if a == "CONTEXT" else a for a in args])
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out


def test_a_text_file_is_not_a_cache(context):
    code, _, err = run("cache", "info", context)
    assert code == 2 and "not a kvstack cache" in err
