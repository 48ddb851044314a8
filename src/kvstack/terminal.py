"""What every `kvstack` command shares: the consoles, one-line errors, reading a context file."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from kvstack.errors import UserError

# piped into a file or a log, tables keep their rows on one line (rich would wrap them at 80 columns)
out = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err = Console(stderr=True)
DEFAULT = "smollm2-135m"


class LogLines:
    """Progress where stderr is not a terminal (a log file, CI), where a bar cannot redraw: a plain
    line "what: done/total, elapsed, time left" at each tenth of the work and at least every
    `every` seconds, once `after` seconds passed (quick work prints nothing)."""

    def __init__(self, description: str, total: int, after: float = 3.0, every: float = 300.0) -> None:
        self.description, self.total, self.after, self.every = description, total, after, every
        self.started = time.monotonic()
        self._said = (0, self.started)  # (tenths of the work, time) at the last line

    def update(self, done: int) -> None:
        """A line if another tenth of the work is done, or `every` seconds passed since the last."""
        now = time.monotonic()
        tenths, last = self._said
        done = min(done, self.total)
        reached = 10 * done // max(self.total, 1)
        elapsed = now - self.started
        if elapsed < self.after or (reached <= tenths and now - last < self.every):
            return
        self._said = (reached, now)
        left = elapsed * (self.total - done) / done if done else float("nan")
        print(
            f"{self.description}: {done}/{self.total}, {elapsed / 60:.1f} min, about {left / 60:.1f} min left",
            file=sys.stderr,
            flush=True,
        )


class LogProgress:
    """The part of rich's `Progress` a sweep uses (`add_task`, `advance`, `update`), as `LogLines`:
    what `kvstack bench` shows in a log, where rich would print the bar only when the sweep ends."""

    def __init__(self, after: float = 3.0) -> None:
        self.after = after  # seconds before the first line
        self._tasks: list[tuple[LogLines, list[int]]] = []

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        return None

    def add_task(self, description: str, total: int) -> int:
        self._tasks.append((LogLines(description, total, self.after), [0]))
        return len(self._tasks) - 1

    def advance(self, task: int, steps: float = 1) -> None:
        lines, done = self._tasks[task]
        done[0] += int(steps)
        lines.update(done[0])

    def update(self, task: int, description: str | None = None) -> None:
        """A new description (what the sweep does now) shows in the next line."""
        if description is not None:
            self._tasks[task][0].description = description


def fail(message: str) -> None:
    """Print a user error as one line on stderr and exit with status 2."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def read_context(path: Path) -> str:
    """A context file's text, or a one-line error naming what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"context file {path} does not exist") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read context file {path}: {e.__class__.__name__}") from None
    if not text.strip():
        raise UserError(f"context file {path} is empty")
    return text


def parse_method(method: str, budget: str, prefill_chunk: int | None = None) -> tuple[Any, Any]:
    """(Stack, Budget) from the command line, checked before anything loads (one-line errors)."""
    from kvstack.cache.budget import Budget
    from kvstack.stack import Stack

    stack, parsed = Stack.parse(method), Budget.parse(budget)
    stack.check_budget(parsed)
    if prefill_chunk is not None and prefill_chunk < 2:
        raise UserError(f"--prefill-chunk {prefill_chunk}: give at least 2 tokens (e.g. 512)")
    return stack, parsed


def print_answer(payload: dict[str, Any], as_json: bool, summary: str) -> None:
    """An answer's payload as one JSON object, or the answer in bold with a one-line `summary`."""
    payload.pop("new_tokens", None)
    if as_json:
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    out.print(f"[bold]{payload['answer']}[/]")
    out.print(summary, highlight=False)
