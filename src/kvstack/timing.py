"""Wall-clock readings that account for the device's queued work (CUDA kernels run asynchronously)."""

from __future__ import annotations

import time

import torch


def now(device: torch.device | None = None) -> float:
    """`time.perf_counter()` once everything queued on `device` has run (use at coarse points only)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """Sums many short intervals; on CUDA with events, so the hot path never waits for the GPU.

    `start(device)` returns a token for `stop(token)`; `seconds` synchronises once, when read.
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, device: torch.device | None) -> float | torch.cuda.Event:
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, token: float | torch.cuda.Event) -> None:
        if isinstance(token, float):
            self._seconds += time.perf_counter() - token
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((token, end))

    def add(self, seconds: float) -> None:
        """Bill time measured elsewhere (e.g. a pass shared by several caches)."""
        self._seconds += seconds

    @property
    def seconds(self) -> float:
        if self._pending:
            self._pending[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._pending) / 1000
            self._pending.clear()
        return self._seconds
