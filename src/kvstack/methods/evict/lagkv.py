"""`lagkv`: judge each chunk of the cache by the next one, attention-free (LagKV, arXiv 2504.04704; paper #20)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    every: int = field(default=16, kw_only=True)  # the paper re-scores as chunks fill, not at every token

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
        n_chunks = max(int(complete.max()), 1)
        # (b, h, t) chunk of each token; sinks and the tail go to a sentinel chunk n that is never a reference
        ids = torch.where((chunk >= 0) & (chunk < n_chunks), chunk, torch.full_like(chunk, n_chunks))
        keys, values = obs.keys.float(), obs.values.float()
        lagged = (_lag_score(keys, ids, scored, valid, n_chunks) + _lag_score(values, ids, scored, valid, n_chunks)) / 2
        rank = _rank_within(lagged, ids, scored, n_chunks) / self.lag
        return torch.where(scored, rank, scores)


def _lag_score(x: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """Per token, the softmax over its chunk of its channel std after min-max normalising by the next chunk.

    x (b, h, t, d); ids (b, h, t) chunk index in [0, n], n the sentinel; scored, valid (b, h, t) -> (b, h, t).
    """
    b, h, t, d = x.shape
    index = ids.unsqueeze(-1).expand(b, h, t, d)
    low = x.new_full((b, h, n + 1, d), float("inf")).scatter_reduce(
        2, index, x.masked_fill(~valid.unsqueeze(-1), float("inf")), "amin"
    )
    high = x.new_full((b, h, n + 1, d), float("-inf")).scatter_reduce(
        2, index, x.masked_fill(~valid.unsqueeze(-1), float("-inf")), "amax"
    )
    ref = (index + 1).clamp(max=n)  # the next chunk's range (only scored chunks, < n - 1, use it)
    low, high = low.gather(2, ref), high.gather(2, ref)
    spread = ((x - low) / (high - low).clamp(min=EPS)).std(dim=-1)
    spread = torch.nan_to_num(spread.masked_fill(~scored, float("-inf")), nan=float("-inf"))
    # softmax within each chunk: subtract the chunk's max, divide by the chunk's sum
    peak = spread.new_full((b, h, n + 1), float("-inf")).scatter_reduce(2, ids, spread, "amax")
    e = torch.exp(spread - peak.gather(2, ids)).nan_to_num(nan=0.0)
    total = e.new_zeros((b, h, n + 1)).scatter_add(2, ids, e)
    return e / total.gather(2, ids).clamp(min=EPS)


def _rank_within(values: torch.Tensor, ids: torch.Tensor, member: torch.Tensor, n: int) -> torch.Tensor:
    """(b, h, t) rank of each member among the members of its chunk (0 = lowest value); others 0."""
    composite = (ids.float() * 4 + values).masked_fill(~member, float("inf"))  # values lie in [0, 1]
    order = composite.argsort(dim=-1, stable=True)
    global_rank = order.argsort(dim=-1, stable=True)
    counts = member.new_zeros(ids.shape[:2] + (n + 1,), dtype=torch.long).scatter_add(2, ids, member.long())
    start = counts.cumsum(-1) - counts  # members of earlier chunks come first in the order
    return torch.where(member, global_rank - start.gather(2, ids), torch.zeros_like(global_rank)).float()
