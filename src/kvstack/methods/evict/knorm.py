"""`knorm`: keys with a low L2 norm draw high attention (Devoto et al., 2024; paper #37)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register


@register
@dataclass
class KNorm(Method):
    """Keep the keys with the lowest L2 norm; needs no attention weights (works with fused attention).

    Score: -||k||_2 over the head dim of keys (b, h, t, d).
    """

    name = "knorm"
    family = "evict"
    paper = "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (#37)"

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.keys.float().norm(dim=-1)
