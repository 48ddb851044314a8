"""`globalk`: one top-k over every layer's and head's tokens (KVzip's and Fast KVzip's eviction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.methods.allocate.base import Allocator, Plan
from kvstack.methods.registry import register


def global_counts(scores: list[torch.Tensor], valid: list[torch.Tensor], total: torch.Tensor) -> torch.Tensor:
    """(L, b, h) tokens each layer's head holds among the `total` (b,) best-scored tokens of a
    sequence over every layer and head: scores, valid per layer (b, h, t_l) (layers may hold
    different numbers of tokens); padding never counts. Ties at the cut are all counted (the
    cache's `distribute` then holds the total)."""
    pairs = list(zip(scores, valid, strict=True))
    flat = torch.cat([s.float().masked_fill(~v, float("-inf")).flatten(1) for s, v in pairs], 1)
    k = total.clamp(min=1, max=flat.shape[1]).long()  # (b,)
    cut = flat.sort(dim=1, descending=True).values.gather(1, (k - 1)[:, None])  # (b, 1) the k-th best score
    return torch.stack([((s >= cut[:, :, None]) & v).sum(-1) for s, v in pairs])


@register
@dataclass
class GlobalK(Allocator):
    """The cache's budget goes to the best-scored tokens wherever they are: one top-k over the
    scores of every layer and head after the prompt, so a layer or head whose tokens score higher
    keeps more of them. KVzip (#30) evicts this way (its scores are attention probabilities, one
    scale for every head), and Fast KVzip (#44) with its gates' probabilities (kvpress's
    `layerwise=False`).

    Only meaningful for scorers whose scores share one scale across layers and heads: `kvzip`,
    `sinkgate` (the log of a probability), attention-based scorers (`snapkv`, `h2o`); not for
    `kvzap`, whose predictor standardises each head's scores. The first tokens and exempt tokens
    score +inf and so always count in their head's share.

    Shapes: per layer scores (b, h, t) -> counts (L, b, h) -> weights (L, b, h) = counts / base.
    """

    name = "globalk"
    paper = "KVzip's and Fast KVzip's global eviction (#30, #44)"
    whole_prompt: ClassVar[bool] = True

    def weights(self, plan: Plan) -> torch.Tensor:
        L, b, h = plan.shape
        scores, valid = [], []
        for layer in range(L):
            scores.append(plan.scores(layer))
            valid.append(plan.observation(layer).valid)
        counts = global_counts(scores, valid, plan.base.sum(0) * h)  # (L, b, h)
        return counts.double() / plan.base.double().clamp(min=1)[:, :, None]
