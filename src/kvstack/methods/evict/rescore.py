"""Base of the methods that wrap another scorer (`vatp(h2o)`, `graphkv(snapkv)`, `scope(snapkv)`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Method


@dataclass
class Rescorer(Method):
    """A method built on another scorer's scores: it records what the wrapped scorer needs, keeps
    as many queries and at least as many tokens, and decodes at its cadence (`every`,
    `decode_window`) unless it says otherwise."""

    cadence_from_inner = True
    scorer: Method = field(default_factory=default_scorer)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.scorer, Method) or not self.scorer.compresses:
            given = getattr(self.scorer, "name", self.scorer)
            raise ValueError(f"{self.name}: scorer must be an eviction scorer such as snapkv, got {given!r}")

    @property
    def query_window(self) -> int:
        return self.scorer.query_window

    @property
    def min_tokens(self) -> int:
        return self.scorer.min_tokens

    def limit(self, keep: torch.Tensor, decoding: bool, confidence: torch.Tensor | None) -> torch.Tensor:
        return self.scorer.limit(keep, decoding, confidence)
