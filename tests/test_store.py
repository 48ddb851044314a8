"""The results store: keyed rows, resume after a kill -9 with nothing lost or counted twice."""

import os
import signal
import subprocess
import sys
import textwrap

from kvstack.bench.store import Cell, Row, Store

CELL = Cell("smollm2-135m", "snapkv", "0.25", "agnostic", "niah_single", 2048)


def test_rows_are_keyed_and_survive_reopening(tmp_path):
    store = Store(tmp_path / "results.sqlite")
    assert store.add(Row(CELL, 0, 0, 1.0, "7391524", ("7391524",), partial=1.0, kv_bytes=10, kv_ratio=0.25))
    assert not store.add(Row(CELL, 0, 0, 0.0, "other", ("7391524",)))  # same key: ignored
    assert store.add(Row(CELL, 1, 0, 0.0, "73", ("7391524",), partial=2 / 7))
    store.close()
    again = Store(tmp_path / "results.sqlite")
    assert again.done(CELL) == {(0, 0), (1, 0)}
    assert again.done(Cell("smollm2-135m", "knorm", "0.25", "agnostic", "niah_single", 2048)) == set()
    rows = list(again.rows())
    assert [r["answer"] for r in rows] == ["7391524", "73"] and rows[0]["refs"] == ["7391524"]


def test_a_killed_writer_loses_nothing_it_finished(tmp_path):
    path = tmp_path / "results.sqlite"
    writer = textwrap.dedent(f"""
        from kvstack.bench.store import Cell, Row, Store
        store = Store(__import__("pathlib").Path({str(path)!r}))
        cell = Cell(*{tuple(CELL.__dict__.values())!r})
        for i in range(100000):
            if (i, 0) not in store.done(cell):
                store.add(Row(cell, i, 0, 1.0, "a", ("a",)))
                print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    last = -1
    while last < 30:
        last = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = Store(path)
    done = store.done(CELL)
    n = len(done)
    assert n >= last + 1 and done == {(i, 0) for i in range(n)}  # in order, nothing reported was lost
    for i in range(n + 5):  # the re-run adds only what is missing
        if (i, 0) not in done:
            assert store.add(Row(CELL, i, 0, 1.0, "a", ("a",)))
    assert store.done(CELL) == {(i, 0) for i in range(n + 5)}
    assert sum(1 for _ in store.rows()) == n + 5  # nothing counted twice


def test_rows_name_their_machine_and_an_older_store_gains_the_column(tmp_path):
    import sqlite3

    from kvstack.bench.store import SCHEMA, machine

    path = tmp_path / "results.sqlite"
    old = sqlite3.connect(path)  # a store written before rows named their machine
    old.execute(SCHEMA.replace(", machine TEXT", ""))
    old.execute(
        "INSERT INTO results (model, method, budget, mode, task, length, sample, question, score, answer, refs, "
        "created) VALUES ('m', 'snapkv', '0.25', 'agnostic', 'niah_single', 2048, 0, 0, 1.0, 'a', '[]', 0)"
    )
    old.commit(), old.close()
    store = Store(path)
    assert store.add(Row(CELL, 1, 0, 1.0, "a", ("a",)))
    rows = {r["sample"]: r for r in store.rows()}
    assert rows[0]["machine"] is None and rows[1]["machine"] == machine()
    assert "torch" in machine() and machine() == machine()  # the CPU (or GPU) and torch's version, once


def test_reading_a_store_leaves_its_file_as_it_was(tmp_path):
    """`kvstack compare` and `report` read a committed store (docs/measurements) without switching
    its journal or adding the machine column, so the tracked file does not change; one that is
    not a store is a one-line error."""
    import hashlib
    import sqlite3

    import pytest

    from kvstack.bench.store import SCHEMA, read_rows
    from kvstack.errors import UserError

    path = tmp_path / "results.sqlite"
    old = sqlite3.connect(path)  # an older store, in the rollback journal a committed copy is left in
    old.execute(SCHEMA.replace(", machine TEXT", ""))
    old.execute(
        "INSERT INTO results (model, method, budget, mode, task, length, sample, question, score, answer, refs, "
        "created) VALUES ('m', 'snapkv', '0.25', 'agnostic', 'niah_single', 2048, 0, 0, 1.0, 'a', '[\"a\"]', 0)"
    )
    old.commit(), old.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    (row,) = read_rows(tmp_path)
    assert row["refs"] == ["a"] and "machine" not in row
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before and sorted(os.listdir(tmp_path)) == [path.name]
    path.write_text("not a database")
    with pytest.raises(UserError, match="not a kvstack results store"):
        read_rows(tmp_path)
