"""Merging: tokens a selection leaves out are folded into kept ones instead of thrown away.

A merging stage decides as data (`Merge`): for each token left out, the kept entry it joins
(`target`, a position in the layer's dense view) and how much of it goes in (`weight`). The
cache executes it with `merge_states`: every entry stands for exp(log_count) tokens, a merged
entry becomes the count-weighted mean of what joins it, and its log-count grows, so attention
(which adds the log-count to the entry's logit) gives the group the mass its tokens had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvstack.methods.base import Observation


@dataclass(frozen=True)
class Merge:
    """A merge decision for one layer. target: (b, h, t) long, the dense position of the kept
    entry each token joins, -1 for none; weight: (b, h, t) float in [0, 1], the share of the
    token that joins (1 = all of it)."""

    target: torch.Tensor
    weight: torch.Tensor

    def into(self, allowed: torch.Tensor) -> Merge:
        """Only merges whose target is `allowed` (b, h, t), e.g. held in the model's dtype."""
        ok = (self.target >= 0) & torch.gather(allowed, -1, self.target.clamp(min=0))
        return Merge(torch.where(ok, self.target, -1), torch.where(ok, self.weight, 0.0))


class Merger:
    """Mixin of a stage that merges: after the selection, `merge(obs, kept)` says where the
    tokens left out go. `log_count`: whether merged entries carry their log-count into
    attention (a field of each merging stage, default from its paper)."""

    merges: ClassVar[bool] = True
    log_count: bool

    def merge(self, obs: Observation, kept: torch.Tensor) -> Merge:
        """Where each token not `kept` (b, h, t) goes; obs as the selection saw it."""
        raise NotImplementedError


def merge_states(
    keys: torch.Tensor, values: torch.Tensor, log_count: torch.Tensor, merge: Merge
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Execute a merge on dense tensors: keys, values (b, h, t, d), log_count (b, h, t).

    Entry j becomes (c_j x_j + sum_i w_i c_i x_i) / (c_j + sum_i w_i c_i) over the tokens i with
    target j, c = exp(log_count), and its log-count log(c_j + sum_i w_i c_i). Returns (keys,
    values, log_count, changed (b, h, t) bool), in float32.
    """
    count = log_count.float().exp()
    joining = merge.target >= 0
    mass = torch.where(joining, merge.weight.float() * count, torch.zeros_like(count))  # (b, h, t)
    target = merge.target.clamp(min=0)
    total = count.scatter_add(-1, target, mass)
    idx = target.unsqueeze(-1)

    def mean(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        summed = (xf * count.unsqueeze(-1)).scatter_add(2, idx.expand_as(xf), xf * mass.unsqueeze(-1))
        return summed / total.unsqueeze(-1)

    hits = torch.zeros_like(count).scatter_add(-1, target, (mass > 0).float())
    changed = hits > 0
    return mean(keys), mean(values), total.log(), changed


def nearest_kept(keys: torch.Tensor, kept: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token, the kept token of its head with the most similar key (cosine):
    (target (b, h, t) long, similarity (b, h, t)); similarity -inf where no token is kept.
    keys (b, h, t, d); kept, valid (b, h, t)."""
    unit = F.normalize(keys.float(), dim=-1)
    sim = unit @ unit.transpose(-1, -2)  # (b, h, t, t)
    sim = sim.masked_fill(~(kept & valid).unsqueeze(-2), float("-inf"))
    best, target = sim.max(-1)
    return target, best
