"""The reuse task: several documents, each holding one fact, cached apart and joined per request
(KVLink, RelayCaching); questions need one document or two. Scored against a full prefill of the
same documents concatenated (`Sample.context`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.bench.tasks.ruler import (
    CountTokens,
    Question,
    Sample,
    _ask_one,
    _needle,
    build_context,
    haystack_sentences,
    key_name,
    magic_number,
    rng_for,
)

SEPARATOR = "\n\n"  # between documents in the full prefill's context


def reuse(
    index: int, length: int, count_tokens: CountTokens, seed: int, prose: Sequence[str], documents: int = 4
) -> Sample:
    """`documents` passages of `prose` (each from its own seeded offset), each about length/documents
    tokens with one needle at a random depth; one question about one document's key and one about
    two documents' keys (both numbers must appear)."""
    rng = rng_for("reuse", index, seed)
    names: list[str] = []
    while len(names) < documents:
        name = key_name(rng)
        if name not in names:
            names.append(name)
    values = [magic_number(rng) for _ in names]
    texts, depths = [], []
    for name, value in zip(names, values, strict=True):
        offset = rng.randrange(len(prose))
        sentence = haystack_sentences("prose", [prose[(offset + i) % len(prose)] for i in range(2000)])
        text, (depth,) = build_context(
            sentence, [(rng.random(), _needle(name, value))], length // documents, count_tokens
        )
        texts.append(text)
        depths.append(depth)
    one = rng.randrange(documents)
    a, b = sorted(rng.sample(range(documents), 2))
    two = Question(
        f"What are the special magic numbers for {names[a]} and for {names[b]} mentioned in the provided text?",
        f"The special magic numbers for {names[a]} and for {names[b]} mentioned in the provided text are",
        (values[a], values[b]),
        max_new_tokens=32,
    )
    return Sample(
        "reuse", index, SEPARATOR.join(texts), (_ask_one(names[one], [values[one]]), two), tuple(depths), tuple(texts)
    )
