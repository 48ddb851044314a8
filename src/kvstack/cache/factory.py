"""The cache class models run with, registered by `kvstack.cache.cache` when it loads.

Calibration runs a model over text with a full cache from a layer below the one that builds
method stacks into caches, and a saved cache is loaded into a fresh one: both ask for one here
instead of importing that layer.
"""

from __future__ import annotations

from typing import Any

_CACHE: Any = None


def register_cache(cls: Any) -> Any:
    """Class decorator: the class `full_cache` builds (`KVCache`)."""
    global _CACHE
    _CACHE = cls
    return cls


def full_cache(model: Any, observe: frozenset[str] = frozenset(), query_window: int = 0) -> Any:
    """A full (uncompressed) cache for `model` recording the statistics in `observe`."""
    if _CACHE is None:
        raise RuntimeError("no cache class is registered: import kvstack (or kvstack.cache.cache) first")
    return _CACHE(model, "full", 1.0, observe=observe, query_window=query_window)


def make_cache(model: Any, stack: Any, budget: Any) -> Any:
    """A cache for `model` under a method stack (a spec string) and a budget (a loaded cache's shell)."""
    if _CACHE is None:
        raise RuntimeError("no cache class is registered: import kvstack (or kvstack.cache.cache) first")
    return _CACHE(model, stack, budget)
