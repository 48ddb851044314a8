"""Multi-turn questions on one compressed context: after the first turns, ask about other facts.

A context (a prose haystack) holds `turns` needles; turn i asks about needle i after the turns
before it, each a question and its answer, as a conversation on the same cache goes. Turn 0 is
a plain needle question; later turns come after earlier answers and ask about facts no earlier
turn named. Eviction decides once what the context keeps, so a fact the first turns did not
need may already be gone; a retrieval tier keeps every fact and brings back what each turn
asks. Earlier answers are the reference ones (teacher-forced), so every method sees the same
conversation and rows differ only by what the cache kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvstack.bench.tasks.ruler import CountTokens, Sample, niah


def multiturn(
    index: int, length: int, count_tokens: CountTokens, seed: int, prose: Sequence[str], turns: int = 4
) -> Sample:
    """`turns` needles in a prose haystack of about `length` tokens; question i comes after turns
    0..i-1 (`Question.history`: chat turns on a chat model)."""
    base = niah("niah_multiturn", index, length, count_tokens, seed, "prose", prose, keys=turns, queries=turns)
    history: tuple[tuple[str, str], ...] = ()
    questions = []
    for q in base.questions:
        questions.append(replace(q, history=history))
        history += ((q.question, f"{q.answer_prefix} {q.answers[0]}."),)
    return replace(base, questions=tuple(questions))
