"""KVLink (#10, Yang et al. 2025): documents' KV caches computed apart, concatenated at request time.

Paper: each retrieved document is encoded alone, once, and its KV cache stored; a request joins the
caches of its documents instead of prefilling their concatenation. Two fixes make the join work:
(1) positions re-encoded: a document encoded from position 0 has its keys' RoPE turned to its place
in the joined sequence; (2) trainable link tokens appended after each document, recomputed at
request time, so attention flows again across documents.

Here: (1) exactly as in the paper (`reencode`, `kvstack.cache.join`); any stack's compressed
caches can be joined (the budget held per document), encoded keys are turned by decoding and
encoding again. (2) without training: the last `link` tokens of each document after the first
(its separator, "\\n\\n" by the segmenting of `segments`) are recomputed on the joined cache, so
they see every document before them; the paper trains new embeddings for that role, which this
training-free toolkit does not. Recomputed tokens are kept whole (exempt from eviction).
Beyond the paper, training-free: `sink` caches each later document after the prompt's first
tokens and leaves them out of the join, so the document's own first token is not an attention
sink (`sink_prefix`; the sink's role is what parallel-encoding methods fix the same way).
Deviations: none in (1); (2) as said. Documents must be single sequences of one model, one stack.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstack.cache.cache import KVCache
from kvstack.cache.join import append_layer, slot_range
from kvstack.errors import UserError
from kvstack.generate import resume


def segments(tokenize: Any, first: list[int], documents: list[str], separator: str = "\n\n") -> list[list[int]]:
    """Token ids of documents to cache apart: `first` (the prompt's start and the first document,
    as the model's prompt builder gives it), then each further document with `separator` after it,
    tokenized alone. Their concatenation is the prompt a full prefill reads (the same ids)."""
    return [first, *(tokenize(doc + separator) for doc in documents)]


def join(
    model: Any,
    documents: list[tuple[list[int], KVCache]],
    reencode: bool = True,
    link: int = 0,
    relay: int = 0,
    sink: int = 0,
) -> KVCache:
    """One cache holding `documents` (each: its ids and its cache, prefilled alone from position 0,
    compressed as its stack says) in order, ready for a question (`generate_from`).

    reencode: turn each document's keys to its place (KVLink's position re-encoding); link: recompute
    each later document's last `link` tokens on the joined cache (training-free link tokens);
    relay: recompute each later document's first `relay` tokens (RelayCaching, `reuse/relaycaching.py`);
    sink: each later document was cached after the same `sink` tokens (the prompt's first ones), which
    took the attention sink's role there: they are left out of the join (`sink_prefix`)."""
    if not documents:
        raise UserError("nothing to join: give at least one document's cache")
    first = documents[0][1]
    for ids, cache in documents:
        if cache.source is not first.source or cache.stack.label != first.stack.label or cache.budget != first.budget:
            raise UserError("documents to join must be cached with one model, one stack and one budget")
        if cache.stack.joiner is not None:
            raise UserError(f"{cache.stack.label} shares storage across layers: its caches cannot be joined")
        if cache.layers[0].seen != len(ids):
            raise UserError(f"a document of {len(ids)} tokens has a cache of {cache.layers[0].seen}: cache it alone")
    joined = KVCache(first.source, first.stack, first.budget)
    shares, planner = joined.policy.shares, first.policy.shares.planner
    if shares.planner is not None and planner is not None:
        shares.planner.plan = planner.plan
    for i, (ids, cache) in enumerate(documents):
        n = len(ids)
        skip = min(sink, n) if i else 0  # cached ahead of the document, left out
        head = min(relay, n - skip) if i else 0  # recomputed first
        tail = min(link, n - skip - head) if i else 0  # recomputed last
        if head:
            _recompute(model, joined, ids[skip : skip + head])
        start = joined.layers[0].seen - head - skip  # where the document's slot 0 lands
        for target, layer in zip(joined.layers, cache.layers, strict=True):
            part = slot_range(layer, skip + head, n - tail) if skip or head or tail else layer
            append_layer(target, part, start, start + n - tail, reencode)
        joined.seq.padding = None
        if tail:
            _recompute(model, joined, ids[n - tail :])
    joined.seq.prompt_end = joined.layers[0].seen
    joined.last_logits = documents[-1][1].last_logits
    return joined


def sink_prefix(documents: list[list[int]], tokens: int = 4) -> list[list[int]]:
    """The documents to cache apart with the prompt's first `tokens` ahead of each later one: a
    document encoded alone from position 0 makes its own first token an attention sink (0.99
    relative error there against a full prefill, `scripts/reuse_deviation.py`); with the prompt's
    start ahead, that role falls on tokens the join leaves out (`join(..., sink=tokens)`)."""
    lead = documents[0][:tokens]
    return [documents[0], *(lead + doc for doc in documents[1:])]


def _recompute(model: Any, cache: KVCache, ids: list[int]) -> None:
    """Run `ids` after what `cache` holds, their KV kept whole (exempt): they see every token before."""
    if not cache.is_initialized:
        raise UserError("the first document is reused as it is: recompute tokens of the later ones")
    runner = resume(model, cache)
    runner.hooks = []  # a prompt pass (KVzip's) scored the documents already
    with cache.exempt():
        runner.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    cache.seq.padding = None
