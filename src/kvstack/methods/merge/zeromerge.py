"""`zeromerge`: ZeroMerge / ZSMerge (Liu et al., 2025): heavy hitters, a recent tail and a residual
entry that absorbs everything else, with compensated attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation, recent_mask
from kvstack.methods.merge.base import Merge, Merger, pinned
from kvstack.methods.registry import register


def residual_slots(
    scores: torch.Tensor, kept: torch.Tensor, existing: torch.Tensor, movable: torch.Tensor, residual: int
) -> torch.Tensor:
    """(b, h, t) the kept entries that serve as residual slots: the `existing` ones (merged
    before), topped up to `residual` per head with the lowest-scoring `movable` kept tokens.
    scores, kept, existing, movable: (b, h, t)."""
    missing = (residual - existing.sum(-1)).clamp(min=0)  # (b, h)
    candidates = kept & movable & ~existing
    low = torch.where(candidates, scores.float(), torch.full_like(scores, float("inf"), dtype=torch.float))
    rank = low.argsort(dim=-1, stable=True).argsort(dim=-1)  # 0 = lowest-scoring candidate
    return existing | (candidates & (rank < missing.unsqueeze(-1)))


def nearest_slot(keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(b, h, t) long: for every token, the residual slot (`slots`, (b, h, t)) whose key has the
    largest dot product with its key (the reference's metric); -1 where a head has no slot.
    keys (b, h, t, d)."""
    width = max(int(slots.sum(-1).max()), 1)
    at = (~slots).to(torch.int8).argsort(dim=-1, stable=True)[..., :width]  # (b, h, s) slot positions first
    real = torch.gather(slots, -1, at)
    slot_keys = torch.gather(keys.float(), 2, at.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    dot = (keys.float() @ slot_keys.transpose(-1, -2)).masked_fill(~real.unsqueeze(-2), float("-inf"))
    best = torch.gather(at, -1, dot.argmax(-1))
    return torch.where(slots.any(-1, keepdim=True), best, -1)


@register
@dataclass
class ZeroMerge(Method, Merger):
    """Each head splits its budget three ways (the paper's multi-dimensional importance, per
    head): the `tail` share of most recent tokens (at least 2), `residual` merge slots, and the
    heavy hitters by accumulated attention (the rest). Every token left out is merged into the
    residual slot whose key has the largest dot product with its own, and merged entries carry
    their log-count into attention (`log_count=True`: compensated attention, the reference's
    scale_factor 1). Residual slots are never evicted; the first compression makes the
    lowest-ranked heavy hitters residual slots, which is the reference's first step (its
    residual group is everything below the top budget - tail - residual tokens).

    Deviations (from SusCom-Lab/ZSMerge mergekv/mergekv.py): scores are the plain accumulated
    attention (`attention_sum`), without the reference's 0.98 per-query decay; while decoding
    the token leaving the tail competes with the heavy hitters by its score (the reference
    always admits it and merges the lowest heavy hitter); with residual > 1 the first merge
    sends each token to its most similar slot instead of splitting the residual tokens into
    contiguous groups; with log_count=False nothing marks a residual entry, so each
    compression chooses new slots. `zeromerge(residual=0)` is the same selection, no merge.

    Shapes: attention_sum (b, h, t) -> scores; keys (b, h, t, d) -> merge target, weight (b, h, t).
    """

    name = "zeromerge"
    family = "merge"
    paper = "ZeroMerge: Parameter-Free KV Cache Compression for Memory-Efficient Long-Context LLMs (arXiv 2503.10714)"
    needs = frozenset({"attention_sum"})
    tail: float = 0.1
    residual: int = 1
    log_count: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.tail <= 1.0:
            raise ValueError(f"zeromerge: tail must be in [0, 1] (share of the budget), got {self.tail}")
        if self.residual < 0:
            raise ValueError(f"zeromerge: residual must be >= 0 (merge slots per head), got {self.residual}")

    @property
    def roles(self) -> frozenset[str]:
        """A merger only while it has a residual (residual > 0); else it evicts what it leaves out."""
        return super().roles if self.residual > 0 else super().roles - {"merger"}

    def score(self, obs: Observation) -> torch.Tensor:
        recent = recent_mask(obs, (obs.keep.float() * self.tail).floor().long().clamp(min=2))
        slots = obs.valid & (obs.log_count > 0)  # residual entries stay
        inf = torch.full_like(obs.attention_sum, float("inf"))
        return torch.where(recent | slots, inf, obs.attention_sum)

    def merge(self, obs: Observation, kept: torch.Tensor) -> Merge:
        scores = self.score(obs)
        movable = torch.isfinite(scores) & ~pinned(obs, self.decode_window)
        slots = residual_slots(scores, kept & obs.valid, kept & obs.valid & (obs.log_count > 0), movable, self.residual)
        target = nearest_slot(obs.keys, slots)
        joins = obs.valid & ~kept & (target >= 0)
        return Merge(torch.where(joins, target, -1), joins.float())
