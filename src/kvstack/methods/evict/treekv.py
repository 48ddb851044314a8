"""`treekv`: TreeKV (He et al., IJCAI 2025, arXiv 2501.04987): smooth eviction with a tree structure.

The paper's wavelet analysis finds that a token's contribution to generation grows, and diverges more
from its neighbours', as it nears the end of the sequence: the cache should hold the distant context
sparsely and the near context densely, with a smooth transition. TreeKV keeps a fixed-size cache of
attention sinks, a recent window and a "tree" region; when the cache overflows, a cyclic pointer
picks a pair of adjacent tokens {idx, idx + 1} and evicts the one with the lower running importance
(attention received / steps in the cache). Each sweep of the pointer halves the old regions, so a
level-k node of the tree stands for 2^k consecutive tokens. The authors released no code.

Our reading, as a pure scoring function for batch eviction (flagged as ours, not the paper's
Algorithm 1 verbatim): the pointer's sweeps leave segments whose size grows geometrically with age,
and each segment's survivor is its most important token. Given the budget, we lay that end state
out directly: `tree_segments` splits the positions between the sinks and the recent window into
exactly as many segments as the tree may keep, sizes r^0, r^1, r^2, ... from the recent window
back (so granularity doubles every log 2 / log r segments), and each segment's best token wins.
Applied at every step while decoding, one newly aged token enters the tree, the boundaries drift,
two held tokens fall into one segment and the weaker of that pair is evicted: the paper's pairwise
comparison, wherever the tree is densest relative to its shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register

BISECTIONS = 64  # float64 bisection steps for the growth ratio: exact to the last bit for any span


@register
@dataclass
class TreeKV(Method):
    """Keep `sinks`, the newest `recent` share of the budget, and one token per tree segment.

    Tree segments cover the positions between the sinks and the recent window; the newest segment
    holds one position and sizes grow by a ratio r >= 1 towards the start (`tree_segments`), so the
    far context is sampled sparsely and the near context densely, filling the tree's share of the
    budget exactly. In each segment the token with the highest running importance survives:
    `attention_sum` / the number of real queries that could attend to it (our reading of "attention
    received / steps in the cache", counted in positions so padding changes nothing).

    Parameters (defaults from the paper's 1024-token setting: 4 sinks, 508 recent, 512 tree):
    `sinks` = 4 first tokens always kept; `recent` = 0.5 share of each head's budget kept as the
    recent window. Prefill and decoding alike; every decoding step (`every` = 1, the paper evicts
    one token per new token).

    Shapes: attention_sum, positions (b, h, t); keep (b, h) -> scores (b, h, t): +inf for sinks
    and the recent window, 2 + importance / max for a segment's survivor, importance / max else.
    """

    name = "treekv"
    family = "evict"
    paper = "TreeKV: Smooth Key-Value Cache Compression with Tree Structures (arXiv 2501.04987)"
    needs = frozenset({"attention_sum"})
    sinks: int = 4
    recent: float = 0.5
    every: int = field(default=1, kw_only=True)  # the paper evicts at every step

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"treekv: sinks must be >= 0 (first tokens always kept), got {self.sinks}")
        if not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"treekv: recent must be in [0, 1] (share of the budget), got {self.recent}")

    @property
    def min_tokens(self) -> int:
        return self.sinks + 1

    def score(self, obs: Observation) -> torch.Tensor:
        valid, pos = obs.valid, obs.positions
        importance = running_importance(obs.attention_sum, pos, valid)
        newest_rank = valid.flip(-1).long().cumsum(-1).flip(-1) - 1  # 0 for each head's newest token
        sink = valid & (pos < self.sinks)
        window = torch.floor(obs.keep.float() * self.recent).long()  # (b, h)
        recent = valid & ~sink & (newest_rank < window.unsqueeze(-1))
        tree = valid & ~sink & ~recent
        budget = (obs.keep - sink.sum(-1) - window).clamp(min=0)  # (b, h) tree tokens to keep
        top = torch.where(tree, pos, torch.full_like(pos, -1)).amax(-1)  # newest tree position
        span = (top - self.sinks + 1).clamp(min=0)  # positions the tree covers
        age = (top.unsqueeze(-1) - pos).clamp(min=0)  # 0 at the tree's newest position
        segment = tree_segments(age, span, budget)
        survivor = best_of_segment(importance, segment, tree, pos, int(budget.max()) if budget.numel() else 0)
        peak = torch.where(tree, importance, torch.zeros_like(importance)).amax(-1, keepdim=True)
        scaled = importance / peak.clamp(min=torch.finfo(importance.dtype).tiny)
        scores = torch.where(survivor & (budget > 0).unsqueeze(-1), 2.0 + scaled, scaled)
        return torch.where(sink | recent, torch.full_like(scores, float("inf")), scores)


def running_importance(attention_sum: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(b, h, t) attention received per query that could see the token (the paper's running average).

    A token at position p was seen by the real queries at positions p .. n - 1 (n real tokens so
    far, the newest position + 1 over the row), so it divides by n - p, at least 1.
    """
    b = pos.shape[0]
    newest = torch.where(valid, pos, torch.full_like(pos, -1)).reshape(b, -1).amax(-1)  # (b,)
    steps = (newest[:, None, None] + 1 - pos).clamp(min=1)
    return attention_sum.float() / steps.float()


def growth_ratio(span: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(b, h) float64 x = r - 1 >= 0 such that count segments of sizes r^0 .. r^(count-1) sum to span.

    span, count: (b, h) long. x = 0 when the segments need not grow (count >= span or count < 2).
    Solved by bisection on S(x) = ((1 + x)^count - 1) / x, increasing in x, with S(span) > span.
    """
    m, n = span.double(), count.double()
    lo, hi = torch.zeros_like(m), m.clamp(min=1.0)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        total = torch.expm1(n * torch.log1p(mid)) / mid.clamp(min=torch.finfo(torch.float64).tiny)
        total = torch.where(mid > 0, total, n)
        above = total > m
        hi, lo = torch.where(above, mid, hi), torch.where(above, lo, mid)
    return torch.where((count >= 2) & (count < span), hi, torch.zeros_like(hi))


def tree_segments(age: torch.Tensor, span: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(b, h, t) long: which of `count` segments each age falls in (0 = the newest segment).

    age (b, h, t): positions back from the tree's newest position; span (b, h): positions the tree
    covers (ages 0 .. span - 1); count (b, h): segments. Segment j starts at age
    round(g(j)), g(j) = (r^j - 1) / (r - 1) = r^0 + ... + r^(j-1), with r from `growth_ratio`, so
    segment j holds about r^j positions and the last one ends at span. Segment boundaries are
    strictly increasing (g grows by r^j >= 1 per segment). With count >= span every position is its
    own segment; with count 0 every age maps to segment 0 (callers treat the tree as empty then).
    """
    x = growth_ratio(span, count)  # (b, h)
    n_max = max(int(count.max()) if count.numel() else 0, 2)
    j = torch.arange(1, n_max, device=age.device, dtype=torch.float64)  # boundaries 1 .. n_max - 1
    xs = x.unsqueeze(-1)
    grown = torch.expm1(j * torch.log1p(xs)) / xs.clamp(min=torch.finfo(torch.float64).tiny)
    starts = torch.floor(torch.where(xs > 0, grown, j) + 0.5).long()  # (b, h, n_max - 1)
    unused = j.long() >= count.unsqueeze(-1)  # boundaries past this head's last segment
    starts = torch.where(unused, torch.full_like(starts, torch.iinfo(torch.long).max), starts)
    return torch.searchsorted(starts, age.contiguous(), right=True)


def best_of_segment(
    importance: torch.Tensor, segment: torch.Tensor, member: torch.Tensor, pos: torch.Tensor, n_segments: int
) -> torch.Tensor:
    """(b, h, t) True for the one member per segment with the highest importance (ties: the oldest).

    importance (b, h, t) float; segment (b, h, t) long in [0, n_segments); member, pos (b, h, t).
    """
    b, h, _ = importance.shape
    ids = torch.where(member, segment, torch.full_like(segment, n_segments)).clamp(max=n_segments)
    value = importance.masked_fill(~member, float("-inf"))
    best = value.new_full((b, h, n_segments + 1), float("-inf")).scatter_reduce(2, ids, value, "amax")
    is_best = member & (value == best.gather(2, ids))
    never = torch.iinfo(torch.long).max
    first = pos.new_full((b, h, n_segments + 1), never).scatter_reduce(
        2, ids, torch.where(is_best, pos, torch.full_like(pos, never)), "amin"
    )
    return is_best & (pos == first.gather(2, ids))
