"""RULER-style synthetic tasks (Hsieh et al., 2024), written for kvstack: the answer is planted by code.

Every generator returns `Sample`s: one context that may carry several questions. Haystacks
are noise (RULER's repeated sentences) or real prose; the context is grown sentence by
sentence until `count_tokens` says it reaches the target length. Samples are seeded with a
stable hash (zlib.crc32), so every method sees the same samples.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJECTIVES = (
    "gentle",
    "silent",
    "bright",
    "hollow",
    "crimson",
    "ancient",
    "rapid",
    "frozen",
    "golden",
    "hidden",
    "lucky",
    "quiet",
    "wild",
    "brave",
    "calm",
    "eager",
    "fancy",
    "jolly",
    "proud",
    "witty",
)
NOUNS = (
    "river",
    "falcon",
    "lantern",
    "meadow",
    "harbor",
    "canyon",
    "violin",
    "orchard",
    "glacier",
    "compass",
    "pepper",
    "marble",
    "thunder",
    "willow",
    "saddle",
    "beacon",
    "cactus",
    "puzzle",
    "harvest",
    "comet",
)
CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class Question:
    """One question about a context; `answers` must all appear in the prediction (RULER string match)."""

    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int = 16
    history: tuple[tuple[str, str], ...] = ()  # earlier (question, answer) turns asked before this one


@dataclass(frozen=True)
class Sample:
    """A context and the questions asked about it, with where the needles sit (depth in [0, 1])."""

    task: str
    index: int
    context: str
    questions: tuple[Question, ...]
    depths: tuple[float, ...] = field(default=())
    # documents that can be cached apart and joined (the reuse task); `context` is them joined by "\n\n"
    documents: tuple[str, ...] = field(default=())


def rng_for(task: str, index: int, seed: int) -> random.Random:
    """A random generator that depends only on (task, index, seed): stable across runs and machines."""
    return random.Random(zlib.crc32(f"{task}/{index}/{seed}".encode()))


def key_name(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def magic_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def haystack_sentences(kind: str, prose: Sequence[str] | None = None) -> Callable[[int], str]:
    """Sentence i of a haystack: `noise` repeats RULER's filler; `prose` walks through `prose` sentences."""
    if kind == "noise":
        parts = [s.strip() + "." for s in NOISE.split(".") if s.strip()]
        return lambda i: parts[i % len(parts)]
    if kind == "prose":
        if not prose:
            raise ValueError("a prose haystack needs sentences")
        return lambda i: prose[i % len(prose)]
    raise ValueError(f"unknown haystack '{kind}': use noise or prose")


def build_context(
    sentence: Callable[[int], str], inserts: Sequence[tuple[float, str]], target_tokens: int, count_tokens: CountTokens
) -> tuple[str, tuple[float, ...]]:
    """Haystack of about `target_tokens` tokens with each (depth, text) insert placed at its depth.

    Returns the context and the realised depths (fraction of haystack sentences before each insert).
    """
    planted = sum(count_tokens(text) for _, text in inserts)
    body: list[str] = []
    used = planted
    while used < target_tokens:
        s = sentence(len(body))
        body.append(s)
        used += count_tokens(" " + s)
    if body and used > target_tokens:
        body.pop()
    placed = sorted(((depth, i, text) for i, (depth, text) in enumerate(inserts)), key=lambda x: (x[0], x[1]))
    out: list[str] = []
    depths: list[float] = [0.0] * len(inserts)
    cursor = 0
    for depth, i, text in placed:
        at = max(cursor, min(len(body), round(depth * len(body))))
        out.extend(body[cursor:at])
        cursor = at
        depths[i] = at / len(body) if body else 0.0
        out.append(text)
    out.extend(body[cursor:])
    return " ".join(out), tuple(depths)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _ask_one(key: str, values: Sequence[str]) -> Question:
    return Question(
        f"What is the special magic number for {key} mentioned in the provided text?",
        f"The special magic number for {key} mentioned in the provided text is",
        tuple(values),
    )


def niah(
    task: str,
    index: int,
    length: int,
    count_tokens: CountTokens,
    seed: int = 0,
    haystack: str = "noise",
    prose: Sequence[str] | None = None,
    keys: int = 1,
    values: int = 1,
    queries: int = 1,
) -> Sample:
    """Needle in a haystack: `keys` needles (distractors included), `values` per key, `queries` keys asked."""
    rng = rng_for(task, index, seed)
    names: list[str] = []
    while len(names) < keys:
        name = key_name(rng)
        if name not in names:
            names.append(name)
    table = {k: [magic_number(rng) for _ in range(values)] for k in names}
    inserts = [(rng.random(), _needle(k, v)) for k in names for v in table[k]]
    context, depths = build_context(haystack_sentences(haystack, prose), inserts, length, count_tokens)
    asked = rng.sample(names, queries)
    if values > 1:
        key = asked[0]
        question = Question(
            f"What are all the special magic numbers for {key} mentioned in the provided text?",
            f"The special magic numbers for {key} mentioned in the provided text are",
            tuple(table[key]),
            max_new_tokens=12 * values,
        )
        questions: tuple[Question, ...] = (question,)
    else:
        questions = tuple(_ask_one(k, table[k]) for k in asked)
    return Sample(task, index, context, questions, depths)


def variable_tracking(
    index: int,
    length: int,
    count_tokens: CountTokens,
    seed: int = 0,
    haystack: str = "noise",
    prose: Sequence[str] | None = None,
    hops: int = 4,
) -> Sample:
    """A chain `VAR A = 12345. VAR B = A. ...` spread through the haystack; name every variable holding it."""
    rng = rng_for("vt", index, seed)
    names = rng.sample([f"{a.upper()[:3]}{n.upper()[:3]}" for a in ADJECTIVES for n in NOUNS], hops + 1)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, hops + 1)]
    spots = sorted(rng.random() for _ in chain)  # in order, so each assignment follows its source
    context, depths = build_context(
        haystack_sentences(haystack, prose), list(zip(spots, chain, strict=True)), length, count_tokens
    )
    q = Question(
        f"Find all variables that are assigned the value {value} in the text above.",
        f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
        "variables are assigned the value " + value + ", they are:",
        tuple(names),
        max_new_tokens=30,
    )
    return Sample("vt", index, context, (q,), depths)


def common_words(index: int, length: int, count_tokens: CountTokens, seed: int = 0, top: int = 10) -> Sample:
    """A numbered word list where `top` words appear far more often; name the most common ones."""
    rng = rng_for("cwe", index, seed)
    vocab = [f"{a}{n}" for a in ADJECTIVES for n in NOUNS]
    rng.shuffle(vocab)
    common, rare = vocab[:top], vocab[top:]
    words: list[str] = []
    tokens = 0
    while tokens < length:
        batch = [*common, *rng.sample(rare, 3)]
        rng.shuffle(batch)
        for w in batch:
            item = f"{len(words) + 1}. {w}"
            tokens += count_tokens(" " + item)
            words.append(item)
    context = "Below is a numbered list of words. " + " ".join(words)
    q = Question(
        f"What are the {top} most common words in the above list?",
        f"Answer: The top {top} words that appear most often in the list are:",
        tuple(common),
        max_new_tokens=8 * top,
    )
    return Sample("cwe", index, context, (q,))
