"""Property-based fuzzing of every input a user types or points at: a method spec, a budget, a task
file, a results store. The contract: a result, or a `UserError` with a one-line message; a stack
that parses also builds a cache and runs a tiny model; labels parse back to what printed them."""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from kvstack.bench.store import SCHEMA, read_rows
from kvstack.bench.tasks.custom import load_task_file
from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.registry import all_methods
from kvstack.stack import Stack

FUZZ = settings(
    max_examples=int(os.environ.get("KVSTACK_FUZZ_EXAMPLES", "150")),
    derandomize=not os.environ.get("KVSTACK_FUZZ_EXAMPLES"),  # CI: the same examples each run; deeper runs explore
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
NAMES = sorted(all_methods())
RUNNABLE = [n for n in NAMES if n != "auto"]  # auto's first plan measures the model for minutes
FRAGMENTS = [
    *NAMES, "(", ")", ",", "=", "+", "'", '"', "plan:", "bits", "every", "window_size", "scorer", "2.0",
    "1e400", "-", "None", "True", "abc", " ", "[", "]", "0", "1.5", "2**64", "()", "(1, 2)", "\\",
]  # fmt: skip


def one_line(err: UserError) -> bool:
    return "\n" not in str(err)


def any_value() -> st.SearchStrategy:
    return st.one_of(
        st.integers(0, 8),
        st.integers(-3, 300),
        st.floats(0, 1),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.none(),
        st.text(max_size=6),
        st.sampled_from(["kvzip", "snapkv", "mean", "channel", "token"]),
        st.tuples(st.integers(0, 64), st.integers(0, 64)),
    )


@st.composite
def stage_specs(draw: st.DrawFn, names: list[str]) -> str:
    """`name(key=value, ...)`: a registered stage with random values for some of its fields."""
    name = draw(st.sampled_from(names))
    declared = [f.name for f in fields(all_methods()[name]) if f.name != "scorer"]
    keys = draw(st.lists(st.sampled_from(declared), unique=True, max_size=3)) if declared else []
    args = [f"{k}={draw(any_value())!r}" for k in keys]
    if "scorer" in {f.name for f in fields(all_methods()[name])} and draw(st.booleans()):
        args.insert(0, draw(st.sampled_from(["snapkv", "keydiff", "h2o", "knorm", "tova"])))
    return f"{name}({', '.join(args)})" if args else name


@st.composite
def stacks(draw: st.DrawFn, names: list[str]) -> str:
    first = draw(stage_specs(names))
    if draw(st.booleans()):
        return f"{first}+{draw(stage_specs(names))}"
    return first


budgets = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.integers(-5, 200).map(lambda n: f"{n}t"),
    st.tuples(st.floats(0, 1e6), st.sampled_from(["B", "KB", "MB", "GB", "TB", "kb"])).map(lambda x: f"{x[0]}{x[1]}"),
    st.text(max_size=12),
)


@FUZZ
@given(text=st.one_of(st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join), st.text(max_size=40)))
def test_any_spec_text_parses_or_is_a_one_line_error(text: str) -> None:
    try:
        Stack.parse(text)
    except UserError as err:
        assert one_line(err), str(err)


@FUZZ
@given(spec=stacks(NAMES))
def test_a_parsed_stack_prints_a_label_that_parses_back_to_it(spec: str) -> None:
    try:
        stack = Stack.parse(spec)
    except UserError as err:
        assert one_line(err), str(err)
        assume(False)
        return
    assert Stack.parse(stack.label) == stack
    assert Stack.parse(str(stack)) == stack


@FUZZ
@given(spec=stacks(RUNNABLE), budget=st.sampled_from(["1.0", "0.5", "0.25", "24t", "6KB"]))
def test_a_stack_that_parses_runs_a_tiny_model_or_says_why_in_one_line(llama, spec: str, budget: str) -> None:
    """The `bits=2.0` class of bug: parsed, then a traceback once the model ran."""
    try:
        stack = Stack.parse(spec)
        cache = KVCache(llama, stack, budget)
        runner = Runner(llama, cache)
        ids = torch.randint(3, 97, (1, 48), generator=torch.Generator().manual_seed(0))
        runner.forward(ids, torch.ones_like(ids))
        runner.forward(ids[:, :1], torch.ones(1, 1, dtype=torch.long))
        event("ran the model")
    except UserError as err:
        assert one_line(err), str(err)


@FUZZ
@given(text=budgets)
def test_any_budget_parses_to_a_label_that_reads_back_or_is_a_one_line_error(text: str) -> None:
    try:
        budget = Budget.parse(text)
    except UserError as err:
        assert one_line(err), str(err)
        return
    assert Budget.parse(str(budget)) == budget


@FUZZ
@given(fraction=st.floats(1e-4, 1.0), tokens=st.integers(1, 2**31 - 1), nbytes=st.integers(1, 2**50))
def test_budget_labels_are_exact(fraction: float, tokens: int, nbytes: int) -> None:
    for budget in (Budget(fraction=fraction), Budget(tokens=tokens), Budget(nbytes=nbytes)):
        assert Budget.parse(str(budget)) == budget


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
task_rows = st.fixed_dictionaries(
    {},
    optional={
        "context": json_values | st.text(max_size=20),
        "question": json_values | st.text(max_size=10),
        "answer": json_values | st.text(max_size=5),
        "answer_prefix": json_values,
        "max_new_tokens": json_values,
    },
)


@FUZZ
@given(
    lines=st.lists(st.one_of(task_rows.map(json.dumps).map(str.encode), st.binary(max_size=30)), max_size=4),
    bom=st.booleans(),
)
def test_any_task_file_loads_or_is_a_one_line_error(tmp_path_factory: pytest.TempPathFactory, lines, bom) -> None:
    path = tmp_path_factory.mktemp("task") / "t.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + b"\n".join(lines))
    try:
        samples = load_task_file(path)
    except UserError as err:
        assert one_line(err), str(err)
        return
    for sample in samples:
        assert isinstance(sample.context, str) and sample.context.strip()
        for q in sample.questions:
            assert isinstance(q.question, str) and q.max_new_tokens >= 1 and not isinstance(q.max_new_tokens, bool)


COLUMNS = ["model", "method", "budget", "mode", "task", "length", "sample", "question", "score", "answer", "refs"]
cells = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.floats(), st.text(max_size=6), st.binary(max_size=4))


@FUZZ
@given(rows=st.lists(st.lists(cells, min_size=len(COLUMNS), max_size=len(COLUMNS)), max_size=5))
def test_a_store_with_any_rows_reads_its_good_rows(tmp_path_factory: pytest.TempPathFactory, rows) -> None:
    folder: Path = tmp_path_factory.mktemp("store")
    db = sqlite3.connect(folder / "results.sqlite")
    db.execute(f"CREATE TABLE results ({', '.join(COLUMNS)})")  # no types: anything goes in
    good = ["m", "snapkv", "0.5", "agnostic", "niah", 100, 0, 0, 1.0, "x", '["x"]']
    db.executemany(f"INSERT INTO results VALUES ({', '.join('?' * len(COLUMNS))})", [good, *rows])
    db.commit()
    db.close()
    read = read_rows(folder)
    assert read[0]["refs"] == ["x"] or any(r["refs"] == ["x"] for r in read)


def test_the_store_schema_and_a_table_without_refs(tmp_path: Path) -> None:
    assert "refs TEXT NOT NULL" in SCHEMA
    db = sqlite3.connect(tmp_path / "results.sqlite")
    db.execute("CREATE TABLE results (model, method, budget, mode, task, length, sample, question, score, answer)")
    db.close()
    with pytest.raises(UserError, match="no column refs"):
        read_rows(tmp_path)
