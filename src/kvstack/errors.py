"""User-facing errors: one line that names the fix, shown without a traceback by the CLI."""

from __future__ import annotations

import difflib


class UserError(Exception):
    """A mistake in the user's input (name, budget, file): the message says how to fix it.

    Always one line: line breaks in what the user typed (and the message quotes) are shown escaped."""

    def __init__(self, message: str) -> None:
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


def unknown_name(kind: str, name: str, valid: list[str]) -> UserError:
    """Error for an unknown name that lists the closest valid names."""
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"valid: {', '.join(sorted(valid))}"
    return UserError(f"unknown {kind} '{name}': {hint}")
