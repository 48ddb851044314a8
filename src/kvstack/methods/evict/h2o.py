"""`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023): accumulated attention plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation, recent_mask
from kvstack.methods.registry import register


@register
@dataclass
class H2O(Method):
    """Keep heavy hitters (most attention received, summed over all queries so far) and recent tokens.

    `recent` is the share of each head's budget given to the most recent tokens (0.5 in the paper);
    the rest goes to the heavy hitters by `attention_sum` (b, h, t). The paper evicts one token per
    decoding step; kvstack evicts a block at once (`every=1` for the paper's cadence).
    """

    name = "h2o"
    family = "evict"
    paper = "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (arXiv 2306.14048)"
    needs = frozenset({"attention_sum"})
    recent: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"h2o: recent must be in [0, 1] (share of the budget), got {self.recent}")

    def score(self, obs: Observation) -> torch.Tensor:
        window = torch.floor(obs.keep.float() * self.recent).long()
        recent = recent_mask(obs, window)
        return torch.where(recent, torch.full_like(obs.attention_sum, float("inf")), obs.attention_sum)
