"""`chunk`: ChunkKV (Liu et al., 2025, arXiv 2502.00299): keep whole chunks of tokens, not scattered ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Observation
from kvstack.methods.evict.rescore import Rescorer
from kvstack.methods.registry import register

TIE = 1e-3  # weight of a token's own score inside its group: orders the tokens of a group cut by the budget


def pool(scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(b, h, t) each valid token's score replaced by the mean finite score of its group, plus TIE
    times its distance from that mean (the group's order among groups is the mean's; a group the
    budget cuts keeps its best tokens). +inf scores (sinks, recent windows) stay +inf.

    scores (b, h, t); groups (b, h, t) int64 >= 0, the group of each token; valid (b, h, t)."""
    finite = valid & torch.isfinite(scores)
    s = torch.where(finite, scores.float(), torch.zeros_like(scores, dtype=torch.float32))
    size = int(groups.max()) + 1 if groups.numel() else 1
    total = s.new_zeros(*s.shape[:-1], size).scatter_add(-1, groups, s)
    count = s.new_zeros(*s.shape[:-1], size).scatter_add(-1, groups, finite.float())
    mean = (total / count.clamp(min=1)).gather(-1, groups)
    pooled = mean + TIE * (s - mean)
    return torch.where(finite, pooled, scores.float())


@register
@dataclass
class Chunk(Rescorer):
    """ChunkKV: a fact spans several tokens, and a scorer that ranks tokens one by one keeps it in
    pieces (digits of a number, words of a name). Cut the sequence into chunks of `size`
    consecutive positions, score each chunk by the mean of its tokens' scores under the wrapped
    `scorer`, and keep chunks whole, best first.

    Deviations: the paper (and kvpress's ChunkKVPress) pools over the heads of a layer and keeps
    the same chunks in each; here each KV head pools its own scores, so per-head budgets and
    allocators (`adakv(chunk(kvzip))`) work as with any scorer. The paper also reuses one layer's
    indices in the next layers; not done. Default `size` 10, the paper's choice.

    Shapes: positions (b, h, t) // size -> groups; inner scores (b, h, t) -> pooled (b, h, t).
    """

    name = "chunk"
    family = "evict"
    paper = (
        "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference (arXiv 2502.00299)"
    )
    size: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.size < 1:
            raise ValueError(f"chunk: size must be >= 1 token, got {self.size}")

    def score(self, obs: Observation) -> torch.Tensor:
        return pool(self.scorer.score(obs), (obs.positions // self.size).clamp(min=0), obs.valid)
