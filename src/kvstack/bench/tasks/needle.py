"""A needle in a haystack of real prose that is always installed: CPython's own documentation.

`python -m kvstack.bench.tasks.needle --out needle.txt` writes a ~4k-token context with the
classic needle (Kamradt's NIAH) at half depth; the question and answer prefix are printed.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER_PREFIX = "The best thing to do in San Francisco is"
ANSWER = "Dolores Park"


@dataclass(frozen=True)
class NeedleSample:
    """A context holding `answer` once, the question that asks for it, and an answer prefix."""

    context: str
    question: str
    answer_prefix: str
    answer: str


def python_docs_words() -> list[str]:
    """CPython's topic documentation (pydoc_data, ~87k tokens) as a list of words, in a fixed order."""
    from pydoc_data.topics import topics

    return re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics))).split(" ")


def insert_at_depth(haystack: str, needle: str, depth: float) -> str:
    """Put `needle` at the sentence boundary nearest `depth` (0 = start, 1 = end) of `haystack`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    at = int(len(haystack) * depth)
    cut = haystack.find(". ", at)
    cut = len(haystack) if cut < 0 else cut + 2
    return f"{haystack[:cut]}{needle} {haystack[cut:]}".strip()


def needle_sample(words: int = 2600, depth: float = 0.5) -> NeedleSample:
    """~1.45 tokens per word for SmolLM2: 2600 words is about 3.8k tokens."""
    hay = " ".join(python_docs_words()[:words])
    return NeedleSample(insert_at_depth(hay, NEEDLE, depth), QUESTION, ANSWER_PREFIX, ANSWER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--words", type=int, default=2600)
    parser.add_argument("--depth", type=float, default=0.5)
    args = parser.parse_args()
    sample = needle_sample(args.words, args.depth)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(sample.context)
    print(f"wrote {args.out}; ask: {sample.question!r} with --answer-prefix {sample.answer_prefix!r}")


if __name__ == "__main__":
    main()
