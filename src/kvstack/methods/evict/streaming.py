"""`streaming`: StreamingLLM (Xiao et al., 2023) keeps attention sinks and a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register


@register
@dataclass
class Streaming(Method):
    """The first `sinks` tokens soak up attention mass; keep them and the most recent rest.

    Scores: +inf for positions < sinks, else the position itself (newer is better).
    """

    name = "streaming"
    family = "evict"
    paper = "StreamingLLM: Efficient Streaming Language Models with Attention Sinks (arXiv 2309.17453)"
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"streaming: sinks must be >= 0, got {self.sinks}")

    @property
    def min_tokens(self) -> int:
        return self.sinks + 1

    def score(self, obs: Observation) -> torch.Tensor:
        pos = obs.positions.float()
        return torch.where(obs.positions < self.sinks, torch.full_like(pos, float("inf")), pos)
