"""`adakv`: Ada-KV (Feng et al., 2024): heads of a layer share its budget by one flattened top-k."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.allocate.base import Allocator
from kvstack.methods.registry import register


@register
@dataclass
class AdaKV(Allocator):
    """The layer's budget goes to its highest-scoring tokens whichever head holds them, so heads
    with concentrated attention give tokens to heads with spread attention. Safeguard: each
    head first keeps `alpha` x its uniform share (alpha 0.2, `floor_alpha` in the authors' code
    and kvpress's AdaKVPress), the rest is the flattened top-k.

    Shapes: scores, valid (b, h, t); keep (b, h) -> (b, h).
    """

    name = "adakv"
    paper = "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (arXiv 2407.11550)"
    splits = True
    alpha: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"adakv: alpha must be in [0, 1] (each head's guaranteed share), got {self.alpha}")

    def split(self, scores: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return adaptive_split(scores, valid, keep, self.alpha)


def adaptive_split(scores: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor, alpha: float) -> torch.Tensor:
    """(b, h) counts: each head's `alpha` share of keep (b, h), then the layer's remaining total
    to the best remaining scores over all heads. scores, valid: (b, h, t)."""
    b, h, t = scores.shape
    n_valid = valid.sum(-1)
    floor = torch.minimum(torch.floor(keep.double() * alpha).long(), n_valid)
    s = scores.float().masked_fill(~valid, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).values  # (b, h, t) best first
    rank = torch.arange(t, device=scores.device)
    # the head's first `floor` tokens are guaranteed: take them out of the competition
    rest = order.masked_fill(rank < floor.unsqueeze(-1), float("-inf")).reshape(b, h * t)
    extra = (torch.minimum(keep, n_valid).sum(-1) - floor.sum(-1)).clamp(min=0)  # (b,)
    top = torch.sort(rest, dim=-1, descending=True, stable=True).indices  # (b, h*t)
    best = torch.gather(rest, 1, top)
    chosen = (torch.arange(h * t, device=scores.device) < extra.unsqueeze(-1)) & (best > float("-inf"))
    won = torch.zeros(b, h * t, dtype=torch.long, device=scores.device).scatter(1, top, chosen.long())
    return floor + won.reshape(b, h, t).sum(-1)
