"""Progress where stderr is not a terminal (a log file, CI): plain lines a log keeps, for
`kvstack bench`'s sweeps and calibration alike (a rich bar redraws only on a terminal)."""

from __future__ import annotations

import sys
import time
from types import TracebackType


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
