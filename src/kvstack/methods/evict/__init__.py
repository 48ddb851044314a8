"""Eviction: score tokens, keep the best within budget."""

from kvstack.methods.evict import (  # noqa: F401
    conf_kv,  # noqa: F401
    dapq,  # noqa: F401
    full,
    graphkv,  # noqa: F401
    h2o,
    keydiff,
    knorm,
    kvcrush,  # noqa: F401
    kvzip,  # noqa: F401
    lagkv,
    random,
    scope,  # noqa: F401
    snapkv,
    streaming,
    tova,
    treekv,  # noqa: F401
    triattention,  # noqa: F401
    vatp,  # noqa: F401
)
