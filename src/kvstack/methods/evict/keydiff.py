"""`keydiff`: distinctive keys draw attention (KeyDiff, arXiv 2504.15364; paper #34)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register


@register
@dataclass
class KeyDiff(Method):
    """Keep the keys least similar to the head's anchor, the mean direction of its keys.

    anchor (b, h, 1, d) = mean over held tokens of the unit-normalised keys (b, h, t, d);
    score = -cos(k_i, anchor). Maximises key diversity; needs no attention weights.
    """

    name = "keydiff"
    family = "evict"
    paper = "KeyDiff: Key Similarity-Based KV Cache Eviction (#34, arXiv 2504.15364)"

    def score(self, obs: Observation) -> torch.Tensor:
        unit = F.normalize(obs.keys.float(), dim=-1) * obs.valid.unsqueeze(-1)  # padding contributes nothing
        anchor = unit.sum(dim=2, keepdim=True) / obs.valid.sum(dim=-1).clamp(min=1)[..., None, None]
        return -F.cosine_similarity(obs.keys.float(), anchor, dim=-1)
