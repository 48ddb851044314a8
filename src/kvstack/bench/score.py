"""Scoring: RULER's string match, and a digit-level partial score for numeric answers."""

from __future__ import annotations

from collections.abc import Sequence


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of reference strings found in the prediction, case-insensitive (RULER's `string_match_all`)."""
    if not references:
        raise ValueError("no reference answers to score against")
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def exact_all(prediction: str, references: Sequence[str]) -> float:
    """1.0 when every reference appears in the prediction, else 0.0."""
    return float(string_match_all(prediction, references) == 1.0)


def digit_partial(prediction: str, reference: str) -> float:
    """Longest prefix of the reference's digits that the prediction's first number reproduces, as a share.

    Eviction often keeps only the first digits of a needle ("73" for "7391524" scores 2/7).
    """
    digits = "".join(ch for ch in reference if ch.isdigit())
    if not digits:
        raise ValueError(f"reference '{reference}' has no digits")
    start = next((i for i, ch in enumerate(prediction) if ch.isdigit()), None)
    if start is None:
        return 0.0
    got = ""
    for ch in prediction[start:]:
        if not ch.isdigit():
            break
        got += ch
    same = 0
    for a, b in zip(got, digits, strict=False):
        if a != b:
            break
        same += 1
    return same / len(digits)
