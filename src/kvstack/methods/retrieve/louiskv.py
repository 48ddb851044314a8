"""`louiskv`: LouisKV (#1), retrieval at semantic boundaries, prompt clusters and output segments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.methods.registry import register
from kvstack.methods.retrieve.squeezed import Squeezed, kmeans


@register
@dataclass
class LouisKV(Squeezed):
    """LouisKV observes that the KVs a decoding step needs change little from one step to the
    next (temporal locality) and differ between the prompt and the generated output. So it
    retrieves only at semantic boundaries: a head ranks afresh when its query has turned away
    from the query of its last retrieval (cosine similarity below `threshold`), and keeps its
    last choice otherwise. And it manages the two parts apart: the prompt's keys are clustered
    by k-means (a unit of similar keys, as in `squeezed`), the output's are cut into runs of the
    sequence (temporal segments). Pages rank by q . centroid (each page's mean key, resident),
    the largest over the KV head's query heads, as in `squeezed` (whose ranking and k-means it
    shares).

    Deviations: the trigger compares each KV head's mean query over its query heads (LouisKV
    compares per query); a multi-token call (a question) always ranks. The remembered choice is
    read back from the tier at every step (kvstack's budget pays for one layer's fetched pages
    at a time), so the trigger saves ranking, not the transfer LouisKV saves by keeping the
    retrieved KVs on the GPU; the query and the choice a head remembers are resident and counted
    (under one token's bytes). Clusters and segments are cut into fixed pages of `page` tokens,
    where LouisKV's units vary in size; no Triton/CUDA kernels.

    Shapes: queries (b, h, g*q, d), means (b, h, P, d) -> (b, h, P); anchor (b, h, d) -> (b, h).
    """

    name = "louiskv"
    paper = "LouisKV: Efficient KV Cache Retrieval for Long Input-Output Sequences (arXiv 2510.11292)"
    remembers: ClassVar[bool] = True
    threshold: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"{self.name}: threshold must be a cosine similarity from -1 to 1, got {self.threshold}")

    def stale(self, queries: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        now = queries.float().mean(2)  # (b, h, d)
        return torch.nn.functional.cosine_similarity(now, anchor.float().to(now.device), dim=-1) < self.threshold

    def arrange(self, keys: torch.Tensor, moved: torch.Tensor, prompt: torch.Tensor | None = None) -> torch.Tensor:
        """Prompt tokens by k-means cluster (about `page` tokens each), then output tokens in
        slot order after every cluster."""
        prompt = torch.ones_like(moved) if prompt is None else prompt
        order = torch.zeros(moved.shape, dtype=torch.long, device=moved.device)
        for b in range(moved.shape[0]):
            for h in range(moved.shape[1]):
                take = (moved[b, h] & prompt[b, h]).nonzero().squeeze(-1)
                clusters = math.ceil(len(take) / self.page)
                if clusters > 1:
                    order[b, h, take] = kmeans(keys[b, h, take].float(), clusters, self.iterations)
                after = (moved[b, h] & ~prompt[b, h]).nonzero().squeeze(-1)
                order[b, h, after] = max(clusters, 1)  # one segment after the clusters, in slot order
        return order
