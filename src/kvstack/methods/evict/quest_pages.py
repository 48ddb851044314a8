"""`quest_pages`: Quest's page criticality (Tang et al., 2024), used to evict whole pages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.base import Method, Observation, recent_mask
from kvstack.methods.registry import register


@register
@dataclass
class QuestPages(Method):
    """Quest splits the cache into pages of `page` tokens and keeps, per page, the channel-wise
    minimum m and maximum M of its keys; the largest dot product any key of the page can have
    with a query q is bounded by sum_i max(q_i m_i, q_i M_i), and the pages with the highest
    bound are the critical ones. Quest selects them anew for each query (the current one) and
    keeps the whole cache; here the bound ranks pages for eviction: each held token scores its
    page's bound, the most any of the last `window_size` (4) queries of its head's group gives
    it, and the window's own tokens are kept (as SnapKV keeps its window). Page 16 is Quest's
    default. Pages are fixed runs of `page` positions of the sequence, as Quest's pages are
    blocks of memory: after an eviction a page bounds the keys it still holds. Retrieval with
    Quest's per-step selection is another method (a slow tier keeps what this one evicts).

    Shapes: queries (b, h*g, w, d), keys (b, h, t, d) -> page bounds (b, h, P, d) -> scores (b, h, t).
    """

    name = "quest_pages"
    family = "evict"
    paper = "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference (arXiv 2406.10774)"
    page: int = 16
    window_size: int = 4
    every: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page < 1:
            raise ValueError(f"{self.name}: page must be >= 1 token, got {self.page}")
        if self.window_size < 1:
            raise ValueError(f"{self.name}: window_size must be >= 1, got {self.window_size}")

    @property
    def query_window(self) -> int:
        return self.window_size

    @property
    def min_tokens(self) -> int:
        return self.window_size

    def score(self, obs: Observation) -> torch.Tensor:
        pages = torch.where(obs.valid, obs.positions // self.page, torch.zeros_like(obs.positions))  # (b, h, t)
        lo, hi = page_bounds(obs.keys, obs.valid, pages)  # (b, h, P, d) each
        b, h, _, _ = obs.keys.shape
        q = obs.queries.float().reshape(b, h, -1, obs.queries.shape[-1])  # (b, h, g*w, d)
        bound = criticality(q, lo, hi)  # (b, h, g*w, P)
        real = obs.query_valid.repeat(1, obs.groups)[:, None, :, None]  # padding queries do not vote
        per_page = bound.masked_fill(~real, float("-inf")).amax(dim=2)  # (b, h, P)
        scores = torch.gather(per_page, -1, pages)
        window = recent_mask(obs, obs.queries.shape[2])
        return torch.where(window, torch.full_like(scores, float("inf")), scores)


def page_bounds(keys: torch.Tensor, valid: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max), each (b, h, P, d): per page, the channel-wise minimum and maximum of its real
    keys (keys (b, h, t, d); valid, pages (b, h, t): each token's page, by its position in its
    sequence, so a padded batch pages a sequence as it is paged alone); 0 for an empty page."""
    b, h, t, d = keys.shape
    n = int(pages.max()) + 1 if pages.numel() else 1
    index = pages.unsqueeze(-1).expand(b, h, t, d)
    k = keys.float()
    lo = k.new_full((b, h, n, d), float("inf")).scatter_reduce(
        2, index, k.masked_fill(~valid[..., None], float("inf")), "amin"
    )
    hi = k.new_full((b, h, n, d), float("-inf")).scatter_reduce(
        2, index, k.masked_fill(~valid[..., None], float("-inf")), "amax"
    )
    empty = lo.isinf() | hi.isinf()
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def criticality(queries: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """(b, h, q, P) Quest's upper bound on q . k over each page's keys: sum_i max(q_i lo_i, q_i hi_i),
    i.e. the positive part of q against the maxima plus the negative part against the minima
    (queries (b, h, q, d); lo, hi (b, h, P, d))."""
    positive, negative = queries.clamp(min=0), queries.clamp(max=0)
    return positive @ hi.transpose(-1, -2) + negative @ lo.transpose(-1, -2)
