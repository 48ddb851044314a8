"""Other caches made from a cache's tokens without running the model again: a `fork` compressed
under another stack and budget, and a `probe` that lends a question's queries back
(`borrow_queries`), so a cache scores what it holds by a question it never stores."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstack.cache.cache import KVCache


def fork(cache: KVCache, stack: Any, budget: Any) -> KVCache:
    """A copy of `cache` compressed now under `stack` (a `Stack`) and `budget`; `cache` is unchanged.

    Prefill once, fork per method: in query-agnostic mode this gives the same cache as
    compressing during prefill (prefill outputs never depend on the cache's compression)."""
    missing = stack.needs - cache.needs
    if missing or stack.query_window > cache.query_window:
        raise ValueError(
            f"this cache did not record what {stack} needs ({', '.join(sorted(missing)) or 'queries'}): "
            f"build it with KVCache(..., observe={set(stack.needs)}, query_window={stack.query_window})"
        )
    new = type(cache)(cache.source, stack, budget)
    new.seq = cache.seq.copy()
    new.signals = {name: dict(per_layer) for name, per_layer in cache.signals.items()}
    new.confidence = cache.confidence
    new.layers[:] = [layer.copy(new.seq, stack.needs, stack.query_window) for layer in cache.layers]
    for layer in new.layers:
        if layer.is_initialized:
            new.policy.maintain(layer, decoding=False)
    return new


def probe(cache: KVCache) -> KVCache:
    """A full cache over `cache`'s tokens (tensors shared, not copied) that records the queries
    `cache`'s stack reads, from its first new token on."""
    new = type(cache)(cache.source, "full", 1.0, query_window=cache.query_window)
    new.seq = cache.seq.copy()
    new.layers[:] = [layer.copy(new.seq, frozenset(), 0) for layer in cache.layers]  # no queries yet
    return new


def borrow_queries(cache: KVCache, probe: KVCache) -> None:
    """Take the queries each layer of `probe` observed last (and their slots) as `cache`'s own."""
    for mine, theirs in zip(cache.layers, probe.layers, strict=True):
        mine.queries, mine.query_slots = theirs.queries, theirs.query_slots
