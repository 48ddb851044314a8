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

from kvstack.methods.base import Observation, recent_mask


@dataclass(frozen=True)
class Merge:
    """A merge decision for one layer. target: (b, h, t) long, the dense position of the kept
    entry each token joins, -1 for none; weight: (b, h, t) float in [0, 1], the share of the
    token that joins (1 = all of it).

    Optional, for methods whose values do not follow their keys (SubGen): value_weight (b, h, t)
    in [0, 1], the share of each joining token's value (None: `weight`); value_scale (b, h, t),
    a factor on each entry's merged value (None: 1). The log-count always follows `weight`.
    """

    target: torch.Tensor
    weight: torch.Tensor
    value_weight: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    def into(self, allowed: torch.Tensor) -> Merge:
        """Only merges whose target is `allowed` (b, h, t), e.g. held in the model's dtype."""
        ok = (self.target >= 0) & torch.gather(allowed, -1, self.target.clamp(min=0))
        value_weight = None if self.value_weight is None else torch.where(ok, self.value_weight, 0.0)
        value_scale = None if self.value_scale is None else torch.where(allowed, self.value_scale, 1.0)
        return Merge(torch.where(ok, self.target, -1), torch.where(ok, self.weight, 0.0), value_weight, value_scale)


class Merger:
    """Mixin of a stage that merges: after the selection, `merge(obs, kept)` says where the
    tokens left out go. `log_count`: whether merged entries carry their log-count into
    attention (a field of each merging stage, default from its paper)."""

    role: ClassVar[str] = "merger"
    log_count: bool

    def merge(self, obs: Observation, kept: torch.Tensor) -> Merge:
        """Where each token not `kept` (b, h, t) goes; obs as the selection saw it."""
        raise NotImplementedError


def merge_states(
    keys: torch.Tensor, values: torch.Tensor, log_count: torch.Tensor, merge: Merge
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Execute a merge on dense tensors: keys, values (b, h, t, d), log_count (b, h, t).

    Entry j becomes (c_j x_j + sum_i w_i c_i x_i) / (c_j + sum_i w_i c_i) over the tokens i with
    target j, c = exp(log_count), and its log-count log(c_j + sum_i w_i c_i). Values use the
    merge's value weights and scale when it has them. Returns (keys, values, log_count, changed
    (b, h, t) bool), in float32.
    """
    count = log_count.float().exp()
    joining = merge.target >= 0
    target = merge.target.clamp(min=0)
    idx = target.unsqueeze(-1)

    def mass_of(weight: torch.Tensor) -> torch.Tensor:  # (b, h, t) count each token brings to its target
        return torch.where(joining, weight.float() * count, torch.zeros_like(count))

    def mean(x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        summed = (xf * count.unsqueeze(-1)).scatter_add(2, idx.expand_as(xf), xf * mass.unsqueeze(-1))
        return summed / count.scatter_add(-1, target, mass).unsqueeze(-1)

    def hits(mass: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(count).scatter_add(-1, target, (mass > 0).float()) > 0

    mass = mass_of(merge.weight)
    value_mass = mass if merge.value_weight is None else mass_of(merge.value_weight)
    new_values = mean(values, value_mass)
    changed = hits(mass) | hits(value_mass)
    if merge.value_scale is not None:
        new_values = new_values * merge.value_scale.float().unsqueeze(-1)
        changed = changed | (merge.value_scale != 1)
    return mean(keys, mass), new_values, count.scatter_add(-1, target, mass).log(), changed


def nearest_kept(keys: torch.Tensor, kept: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token, the kept token of its head with the most similar key (cosine):
    (target (b, h, t) long, similarity (b, h, t)); similarity -inf where no token is kept.
    keys (b, h, t, d); kept, valid (b, h, t)."""
    unit = F.normalize(keys.float(), dim=-1)
    sim = unit @ unit.transpose(-1, -2)  # (b, h, t, t)
    sim = sim.masked_fill(~(kept & valid).unsqueeze(-2), float("-inf"))
    best, target = sim.max(-1)
    return target, best


def pinned(obs: Observation, decode_window: int) -> torch.Tensor:
    """(b, h, t) tokens the cache keeps whatever a stage scores: exempt ones (a question appended
    after a query-agnostic compression) and, while decoding, the newest `decode_window`. A
    merging plan leaves them out of its clusters, so that the tokens it keeps are the ones kept."""
    out = obs.exempt
    if obs.decoding and decode_window:
        out = out | recent_mask(obs, decode_window)
    return out
