"""RULER-style QA: the gold paragraph among distractor paragraphs, numbered as documents.

Built on Disfl-QA (SQuAD 2.0 paragraphs, questions spoken with a correction): the answer is a
span of the gold paragraph, and a distractor never holds it, so what the cache kept of that
paragraph decides the score.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.bench.tasks.ruler import CountTokens, Question, Sample, rng_for


def qa(index: int, length: int, count_tokens: CountTokens, seed: int, examples: Sequence[dict[str, str]]) -> Sample:
    """Documents from other examples until `length` tokens, the gold one at a seeded depth."""
    if len(examples) < 2:
        raise ValueError("qa needs at least two examples (one gold, distractors)")
    rng = rng_for("qa", index, seed)
    gold = examples[rng.randrange(len(examples))]
    docs: list[str] = []
    used = count_tokens(gold["context"]) + 8
    order = rng.sample(range(len(examples)), len(examples))
    for i in order:
        ex = examples[i]
        if ex["question"] == gold["question"] or gold["answer"] in ex["context"]:
            continue  # a distractor must not answer the question
        cost = count_tokens(ex["context"]) + 8
        if used + cost > length:
            break
        docs.append(ex["context"])
        used += cost
    at = rng.randint(0, len(docs))
    docs.insert(at, gold["context"])
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    question = Question(
        f"Answer the question based on the given documents. Question: {gold['question']}",
        "Answer:",
        (gold["answer"],),
        max_new_tokens=24,
    )
    return Sample("qa", index, context, (question,), (at / max(len(docs) - 1, 1),))
