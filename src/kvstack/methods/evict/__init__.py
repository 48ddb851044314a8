"""Eviction: score tokens, keep the best within budget."""

from kvstack.methods.evict import full, h2o, keydiff, knorm, lagkv, random, snapkv, streaming, tova  # noqa: F401
