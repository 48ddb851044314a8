"""Admission by KV bytes: pure functions that size a request's cache before and after its
prefill, and the `Ledger` that admits requests while their reservations fit in `--kv-memory`.

A request reserves, before its prefill, the larger of the full cache its prompt briefly holds
while it goes in (compression follows the prefill) and what its compressed cache will hold at its
last token; after the prefill the reservation follows the bytes measured on its cache."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvstack.cache.budget import Budget


def final_bytes(budget: Budget, held: int, tokens: int, new_tokens: int, token_bytes: int) -> int:
    """Bytes a sequence holding `held` bytes for `tokens` tokens will hold at most after
    `new_tokens` more: a fraction keeps its ratio as the sequence grows, a size caps it, a token
    count per head (or a method compressing every few steps) may hold each new token until pruned."""
    if budget.fraction is not None and not budget.is_full and tokens:
        return max(held, -(-held * (tokens + new_tokens) // tokens))
    grown = held + new_tokens * token_bytes
    return max(held, min(grown, budget.nbytes)) if budget.nbytes is not None else grown


def first_bytes(budget: Budget, prompt_tokens: int, new_tokens: int, token_bytes: int, stored: bool) -> int:
    """What a request reserves before its prefill: its prompt as a full cache (a prefill holds the
    whole prompt before compressing it) unless its context comes compressed from the prefix store,
    and at least its compressed cache at the last token, sized by the budget."""
    full = prompt_tokens * token_bytes
    if budget.fraction is not None:
        compressed = int(full * budget.fraction)
    elif budget.nbytes is not None:
        compressed = min(full, budget.nbytes)
    else:
        compressed = full
    end = final_bytes(budget, compressed, prompt_tokens, new_tokens, token_bytes)
    return end if stored else max(full, end)


@dataclass
class Ledger:
    """Bytes reserved per running request against `capacity`; thread-safe. `held` are the bytes
    the caches hold now (measured), `reserved` what admission counts (never less than held)."""

    capacity: int
    reserved: dict[int, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)
    peak_held: int = 0
    peak_reserved: int = 0
    peak_running: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fits(self, nbytes: int) -> bool:
        """Whether a request reserving `nbytes` fits beside the running ones."""
        with self._lock:
            return sum(self.reserved.values()) + nbytes <= self.capacity

    def reserve(self, key: int, nbytes: int) -> None:
        with self._lock:
            self.reserved[key] = nbytes
            self.held.setdefault(key, 0)
            self.peak_running = max(self.peak_running, len(self.reserved))
            self.peak_reserved = max(self.peak_reserved, sum(self.reserved.values()))

    def measure(self, key: int, held: int, reserve: int | None = None) -> None:
        """Record the bytes request `key` holds now; its reservation becomes `reserve` (what it
        will hold at most from now on), never below what it holds."""
        with self._lock:
            self.held[key] = held
            self.reserved[key] = max(held, reserve if reserve is not None else self.reserved.get(key, 0))
            self.peak_held = max(self.peak_held, sum(self.held.values()))
            self.peak_reserved = max(self.peak_reserved, sum(self.reserved.values()))

    def release(self, key: int) -> None:
        with self._lock:
            self.reserved.pop(key, None)
            self.held.pop(key, None)

    def totals(self) -> tuple[int, int, int]:
        """(bytes held, bytes reserved, requests running) now."""
        with self._lock:
            return sum(self.held.values()), sum(self.reserved.values()), len(self.reserved)
