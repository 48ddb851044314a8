"""`lagkv`: judge each chunk of the cache by the next one, attention-free (LagKV, arXiv 2504.04704; paper #20)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register

EPS = 1e-6  # a reference channel with no range normalises to 0 instead of NaN


@register
@dataclass
class LagKV(Method):
    """Tokens after the `sinks` fall in chunks of `lag` positions; chunk c is scored against chunk c + 1.

    For each channel, chunk c's keys (and values) are min-max normalised by the range of chunk c + 1
    (its lag reference); a token's score is the softmax, within its chunk, of the standard deviation of
    its normalised channels, key and value averaged, then turned into its rank within the chunk / lag.
    Sinks are always kept; the last complete chunk and the tail (no reference yet) rank above every
    scored chunk, newest first, so short sequences behave like StreamingLLM. Shapes: keys, values
    (b, h, t, d) -> scores (b, h, t). Reference: the authors' code and kvpress's LagKVPress.
    """

    name = "lagkv"
    family = "evict"
    paper = "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important (#20, 2504.04704)"
    sinks: int = 4
    lag: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0 or self.lag < 2:
            raise ValueError(f"lagkv: needs sinks >= 0 and lag >= 2, got sinks={self.sinks}, lag={self.lag}")

    @property
    def min_tokens(self) -> int:
        return self.sinks + 1

    def score(self, obs: Observation) -> torch.Tensor:
        pos, valid = obs.positions, obs.valid
        newest = torch.where(valid, pos, torch.full_like(pos, -1)).amax(dim=-1, keepdim=True)  # (b, h, 1)
        chunk = torch.div(pos - self.sinks, self.lag, rounding_mode="floor")
        complete = torch.div(newest + 1 - self.sinks, self.lag, rounding_mode="floor")  # whole chunks per head
        scored = valid & (pos >= self.sinks) & (chunk < complete - 1)  # chunks that have a complete reference
        # unscored: sinks first, then the newest tokens of the tail above any rank in [0, 1)
        tail = 2.0 + pos.float() / (newest.float() + 1)
        scores = torch.where(pos < self.sinks, torch.full_like(tail, float("inf")), tail)
        keys, values = obs.keys.float(), obs.values.float()
        for c in range(max(int(complete.max()) - 1, 0)):
            members, reference = scored & (chunk == c), valid & (chunk == c + 1)
            if not bool(members.any()):
                continue
            lagged = (_lag_score(keys, members, reference) + _lag_score(values, members, reference)) / 2
            order = lagged.masked_fill(~members, float("inf")).argsort(dim=-1, stable=True)
            rank = order.argsort(dim=-1, stable=True).float() / self.lag  # (b, h, t): rank within the chunk
            scores = torch.where(members, rank, scores)
        return scores


def _lag_score(x: torch.Tensor, members: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Softmax over a chunk's tokens of the channel std after min-max normalising by the reference chunk.

    x (b, h, t, d); members, reference (b, h, t) masks -> (b, h, t), meaningful where `members`.
    """
    ref = reference.unsqueeze(-1)
    low = x.masked_fill(~ref, float("inf")).amin(dim=2, keepdim=True)
    high = x.masked_fill(~ref, float("-inf")).amax(dim=2, keepdim=True)
    spread = ((x - low) / (high - low).clamp(min=EPS)).std(dim=-1)
    return torch.nan_to_num(spread.masked_fill(~members, float("-inf")).softmax(dim=-1), nan=0.0)
