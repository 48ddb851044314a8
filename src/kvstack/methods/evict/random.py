"""`random`: keep a random subset, the floor any scorer must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register


@register
@dataclass
class Random(Method):
    """Uniformly random scores, a fixed function of (seed, layer, head, position): reproducible,
    and the same for a sequence alone or in a batch."""

    name = "random"
    family = "evict"
    paper = "baseline"
    seed: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + obs.layer_idx)
        b, h, _ = obs.positions.shape
        table = torch.rand(h, int(obs.positions.max()) + 1, generator=gen).to(obs.positions.device)  # (h, pos)
        return torch.gather(table.unsqueeze(0).expand(b, -1, -1), 2, obs.positions)
