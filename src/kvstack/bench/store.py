"""Benchmark results in SQLite: one row per (cell, sample, question), written as each finishes.

A cell is one point of a sweep (model, method, budget, mode, task, length). Rows are keyed,
so re-running a sweep skips what is stored and nothing is counted twice; each row is
committed on its own (WAL journal), so a kill -9 loses at most the sample in flight.
"""

from __future__ import annotations

import functools
import json
import math
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvstack.cache.budget import Budget
from kvstack.errors import UserError

CELL = ("model", "method", "budget", "mode", "task", "length")
SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
  model TEXT NOT NULL, method TEXT NOT NULL, budget TEXT NOT NULL, mode TEXT NOT NULL,
  task TEXT NOT NULL, length INTEGER NOT NULL, sample INTEGER NOT NULL, question INTEGER NOT NULL,
  score REAL NOT NULL, partial REAL, answer TEXT NOT NULL, refs TEXT NOT NULL, kl REAL, ppl REAL,
  kv_bytes INTEGER, kv_bytes_full INTEGER, kv_ratio REAL,
  prefill_s REAL, compress_s REAL, decode_tokens_per_s REAL, peak_rss_mb REAL,
  created REAL NOT NULL, machine TEXT,
  PRIMARY KEY (model, method, budget, mode, task, length, sample, question)
)
"""


@dataclass(frozen=True)
class Cell:
    """One point of a sweep."""

    model: str
    method: str
    budget: str
    mode: str
    task: str
    length: int


@dataclass(frozen=True)
class Row:
    """One scored answer with the measurements of the run that produced it."""

    cell: Cell
    sample: int
    question: int
    score: float
    answer: str
    refs: tuple[str, ...]
    partial: float | None = None
    kv_bytes: int | None = None
    kv_bytes_full: int | None = None
    kv_ratio: float | None = None
    prefill_s: float | None = None
    compress_s: float | None = None
    decode_tokens_per_s: float | None = None
    peak_rss_mb: float | None = None
    kl: float | None = None  # fidelity: mean KL(full || compressed) of next-token distributions
    ppl: float | None = None  # fidelity: perplexity of the real continuation


class Store:
    """The results file of one benchmark directory."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, timeout=60)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(SCHEMA)
        columns = {r[1] for r in self.db.execute("PRAGMA table_info(results)")}
        if "machine" not in columns:  # a store written before rows named their machine
            self.db.execute("ALTER TABLE results ADD COLUMN machine TEXT")
        self.db.commit()

    def done(self, cell: Cell) -> set[tuple[int, int]]:
        """(sample, question) pairs already stored for `cell`."""
        where = " AND ".join(f"{k} = ?" for k in CELL)
        cur = self.db.execute(f"SELECT sample, question FROM results WHERE {where}", astuple_cell(cell))
        return {(s, q) for s, q in cur}

    def add(self, row: Row) -> bool:
        """Store a row unless its key is there already; True if it was new. Committed at once."""
        values = {**asdict(row.cell), **{f.name: getattr(row, f.name) for f in fields(Row) if f.name != "cell"}}
        values["refs"] = json.dumps(list(row.refs))
        values["created"] = time.time()
        values["machine"] = machine()
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        cur = self.db.execute(f"INSERT OR IGNORE INTO results ({cols}) VALUES ({marks})", tuple(values.values()))
        self.db.commit()
        return cur.rowcount == 1

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every stored row as a dict (refs decoded)."""
        return stored_rows(self.db)

    def close(self) -> None:
        self.db.close()


@functools.cache
def machine() -> str:
    """What computed a row, as far as its last bits go: the CPU (or GPU), torch's kernels for it
    and torch's version. Under one stack and budget, SmolLM2's answers to 20 multi-key needles
    differed in 3 between an earlier machine and a 2-core AMD EPYC (AVX512-BF16)."""
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    name = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        amx = " AMX" if "amx_bf16" in info else ""
    except (OSError, StopIteration):
        amx = ""
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}{amx}), torch {torch.__version__}"


def astuple_cell(cell: Cell) -> tuple[Any, ...]:
    return tuple(getattr(cell, k) for k in CELL)


def read_rows(out_dir: Path, console: Any = None) -> list[dict[str, Any]]:
    """Every valid row of a benchmark folder's store, or a one-line error saying how to get them.
    A row a reader cannot use (a NULL score, refs that are not JSON) is skipped with one line on
    stderr naming the row and the column; the others are read."""
    from rich.console import Console

    path = out_dir / "results.sqlite"
    if not path.exists():
        raise UserError(f"no results in {out_dir}: run `kvstack bench --out {out_dir}` first")
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=60)  # a reader never writes
    problems: list[str] = []
    try:
        rows = list(stored_rows(db, problems))
    except sqlite3.DatabaseError as err:
        raise UserError(f"{path} is not a kvstack results store ({err}): give a folder `kvstack bench` wrote") from None
    except MissingColumns as err:
        raise UserError(f"{path} has no column {err}: give a folder `kvstack bench` wrote") from None
    finally:
        db.close()
    console = console or Console(stderr=True)
    for problem in problems[:5]:
        console.print(f"[yellow]{path}: skipped {problem}[/]", highlight=False)
    if len(problems) > 5:
        console.print(f"[yellow]{path}: skipped {len(problems) - 5} more rows like these[/]", highlight=False)
    return rows


class MissingColumns(Exception):
    """A results table without a column every reader needs (its message: the columns)."""


REQUIRED = {**dict.fromkeys(CELL[:-1], str), "length": int, "sample": int, "question": int, "score": float}
NUMBERS = ("partial", "kl", "ppl", "kv_bytes", "kv_bytes_full", "kv_ratio", "prefill_s", "compress_s")
OPTIONAL = (*NUMBERS, "decode_tokens_per_s", "peak_rss_mb", "created")  # `machine` stays absent when it is


def stored_rows(db: sqlite3.Connection, problems: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Every row of a results table as a dict (refs decoded; `machine` absent from older stores).
    A row with a value of the wrong kind is left out and described in `problems` (when given)."""
    cur = db.execute(
        "SELECT rowid AS _rowid, * FROM results ORDER BY model, task, length, mode, method, budget, sample"
    )
    names = [d[0] for d in cur.description]
    missing = [c for c in (*REQUIRED, "answer", "refs") if c not in names]
    if missing:
        raise MissingColumns(", ".join(missing))
    absent = [c for c in OPTIONAL if c not in names]  # older or hand-made stores lack measurements
    for values in cur:
        row = dict(zip(names, values, strict=True)) | dict.fromkeys(absent)
        why = _invalid(row)
        if why:
            if problems is not None:
                problems.append(f"row {row['_rowid']}: {why}")
            continue
        del row["_rowid"]
        row["refs"] = json.loads(row["refs"])
        yield row


def _invalid(row: dict[str, Any]) -> str | None:
    """Why a stored row cannot be read (which column, what is there), or None."""
    for column, kind in REQUIRED.items():
        value = row[column]
        if kind is str and not isinstance(value, str):
            return f"{column} is {value!r}, not text"
        if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{column} is {value!r}, not an integer"
        if kind is float and not _finite(value):
            return f"{column} is {value!r}, not a number"
    for column in NUMBERS:
        if row.get(column) is not None and not _finite(row[column]):
            return f"{column} is {row[column]!r}, not a number"
    if not isinstance(row["answer"], str):
        return f"answer is {row['answer']!r}, not text"
    try:
        Budget.parse(row["budget"])
    except UserError:
        return f"budget is {row['budget'][:40]!r}, not a budget"
    try:
        refs = json.loads(row["refs"]) if isinstance(row["refs"], str) else None
    except ValueError:
        refs = None
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        return f"refs is {str(row['refs'])[:40]!r}, not a JSON list of strings"
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
