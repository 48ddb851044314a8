"""What every `kvstack` command shares: the consoles, one-line errors, reading a context file."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from kvstack.errors import UserError

# piped into a file or a log, tables keep their rows on one line (rich would wrap them at 80 columns)
out = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err = Console(stderr=True)
DEFAULT = "smollm2-135m"


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
