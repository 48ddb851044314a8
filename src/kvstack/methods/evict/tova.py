"""`tova`: Token Omission Via Attention (Oren et al., 2024): drop what the newest query ignores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register


@register
@dataclass
class TOVA(Method):
    """Score each token by the last query's attention, averaged over all heads of the layer.

    The same tokens are kept in every head (the paper's layer-wise policy). The paper evicts one
    token per step; kvstack evicts a block at once (`every=1` for the paper's cadence).
    """

    name = "tova"
    family = "evict"
    paper = "Transformers are Multi-State RNNs (TOVA, arXiv 2401.06104)"
    needs = frozenset({"last_attention"})

    def score(self, obs: Observation) -> torch.Tensor:
        layer_mean = obs.last_attention.mean(dim=1, keepdim=True)  # (b, 1, t)
        return layer_mean.expand_as(obs.last_attention)
