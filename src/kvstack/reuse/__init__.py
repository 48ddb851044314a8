"""Reuse of compressed contexts across requests: a store of saved caches (`PrefixStore`)."""

from kvstack.reuse.store import PrefixStore

__all__ = ["PrefixStore"]
