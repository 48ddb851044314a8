"""RelayCaching (#60, 2026): reuse a cache computed in another context, recomputing only the tokens
the new context changes most.

Paper: KV of identical content is highly consistent across contexts; the deviations a new prefix
induces are sparse and localized in a few layers and token positions, so recomputing those
positions restores accuracy at >80% reuse. The paper selects them from measured deviations.

Here: a document's cache, computed alone from position 0 (and compressed as its stack says), is
joined after the earlier documents (KVLink's position re-encoding, `reuse/kvlink.py`), and its
first `tokens` tokens are recomputed on the joined cache before the rest is appended: measured on
SmolLM2 (`scripts/reuse_deviation.py`, docs/measurements/reuse-deviation), that is where the
deviation from a full prefill concentrates: the first token of a document encoded alone is its
attention sink. Deviations: a fixed leading span instead of positions selected per request from
measured deviations (measuring them costs the prefill that reuse avoids); recomputed tokens are
kept whole (exempt from eviction), so the joined cache holds `tokens` more per later document.
"""

from __future__ import annotations

from typing import Any

from kvstack.cache.cache import KVCache
from kvstack.reuse.kvlink import join


def relay(model: Any, documents: list[tuple[list[int], KVCache]], tokens: int = 16, reencode: bool = True) -> KVCache:
    """`documents` (ids, cache computed alone) joined, each later one's first `tokens` recomputed."""
    return join(model, documents, reencode=reencode, relay=tokens)
