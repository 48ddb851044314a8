"""`squeezed`: Squeezed Attention (Hooper et al., 2024), pages of similar keys found by k-means."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.methods.registry import register
from kvstack.methods.retrieve.base import Retriever


@register
@dataclass
class Squeezed(Retriever):
    """Squeezed Attention groups a fixed context's keys by k-means, one centroid per cluster;
    a query is compared with the centroids and only the keys of the clusters it matches are
    loaded for exact attention. Here the tokens the resident scorer lets go are clustered per
    KV head (k-means over their keys, about `page` tokens per cluster, `iterations` Lloyd steps)
    and written to the slow tier cluster by cluster, so a page holds similar keys, not a run of
    the text; the resident index keeps each page's key mean (its centroid: d values a page, half
    of Quest's minimum and maximum), and a query ranks pages by q . mean, the largest over the
    query heads of the group.

    Deviations: clusters are cut into pages (a large cluster spans several, each with its own
    mean; small ones share one); the paper keeps the keys whose centroid scores pass a threshold,
    here the budget's number of pages; one level of centroids, not the hierarchical lookup; tokens
    evicted while decoding (a block at a time) are clustered within their block.

    Shapes: keys (b, h, t, d) -> cluster order (b, h, t); queries (b, h, g*q, d), means (b, h, P, d) -> (b, h, P).
    """

    name = "squeezed"
    paper = "Squeezed Attention: Accelerating Long Context Length LLM Inference (arXiv 2411.09688)"
    summaries: ClassVar[tuple[str, ...]] = ("mean",)
    iterations: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.iterations < 1:
            raise ValueError(f"{self.name}: iterations must be >= 1 (k-means steps), got {self.iterations}")

    def rank(
        self, queries: torch.Tensor, index: dict[str, torch.Tensor], text: torch.Tensor | None = None
    ) -> torch.Tensor:
        return (queries.float() @ index["mean"].float().transpose(-1, -2)).amax(dim=2)

    def arrange(self, keys: torch.Tensor, moved: torch.Tensor, prompt: torch.Tensor | None = None) -> torch.Tensor:
        order = torch.zeros(moved.shape, dtype=torch.long, device=moved.device)
        for b in range(moved.shape[0]):
            for h in range(moved.shape[1]):
                take = moved[b, h].nonzero().squeeze(-1)
                if len(take) > self.page:
                    clusters = math.ceil(len(take) / self.page)
                    order[b, h, take] = kmeans(keys[b, h, take].float(), clusters, self.iterations)
        return order


def kmeans(points: torch.Tensor, k: int, iterations: int) -> torch.Tensor:
    """(n,) the cluster of each of points (n, d) after `iterations` Lloyd steps from k evenly
    spaced points (deterministic: a sequence clusters alike alone or in a batch)."""
    centroids = points[torch.linspace(0, len(points) - 1, k).round().long()]
    for _ in range(iterations):
        labels = torch.cdist(points, centroids).argmin(-1)
        sums = torch.zeros_like(centroids).index_add_(0, labels, points)
        counts = torch.bincount(labels, minlength=k).unsqueeze(-1)
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)  # an empty cluster stays put
    return torch.cdist(points, centroids).argmin(-1)
