"""`pyramid`: PyramidKV (Cai et al., 2024): more tokens in the lower layers, fewer higher up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.allocate.base import Allocator, Plan
from kvstack.methods.registry import register


def pyramid_shares(n_layers: int, beta: float) -> torch.Tensor:
    """(L,) each layer's budget relative to the mean: an arithmetic series from the bottom layer
    (2 - 1/beta) down to the top (1/beta), mean 1 (PyramidKV's `min = budget / beta`,
    `max = 2 budget - min`; reference code pyramidkv_utils.py)."""
    if n_layers == 1:
        return torch.ones(1)
    top, bottom = 1.0 / beta, 2.0 - 1.0 / beta
    return torch.linspace(bottom, top, n_layers, dtype=torch.float64)


@register
@dataclass
class Pyramid(Allocator):
    """Attention funnels from broad (lower layers) to focused (upper layers), so lower layers
    keep more: layer l's budget follows `pyramid_shares` (beta 20 as in the paper's code).
    The scorer (SnapKV in the paper) picks each layer's tokens. A priori: no statistics needed.
    """

    name = "pyramid"
    paper = "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (arXiv 2406.02069)"
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"pyramid: beta must be >= 1 (top layer keeps budget / beta), got {self.beta}")

    def weights(self, plan: Plan) -> torch.Tensor:
        L, b, h = plan.shape
        return pyramid_shares(L, self.beta)[:, None, None].expand(L, b, h)
