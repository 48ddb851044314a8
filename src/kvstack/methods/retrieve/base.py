"""Base of retrieval methods: what stays resident, what moves to the slow tier, what comes back.

A retriever plays two parts. As a scorer it says which tokens stay resident (its `scorer`, by
default StreamingLLM's sinks and recent window); every other token moves to the layer's slow
tier (`kvstack.cache.tier`) instead of being dropped. Before each attention call it ranks the
tier's pages by the current queries (`rank`, the paper's part) and the best come back for that
call only. The byte budget pays for what is resident: the tokens held, the tier's page index,
and the pages brought back for one layer at a time (`resident_share`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Method, Observation
from kvstack.methods.evict.rescore import Rescorer


@dataclass
class Retriever(Rescorer):
    """A method that moves the tokens its `scorer` does not keep resident to a slow tier (stored
    at `bits`: 8 halves what is written and read back, with a scale per token) and retrieves
    `select` of them (whole pages of `page` tokens) per head at each attention call.
    It evicts at its own cadence (a block per head while decoding), not its scorer's."""

    role: ClassVar[str] = "retriever"
    family: ClassVar[str] = "retrieve"
    cadence_from_inner: ClassVar[bool] = False
    summaries: ClassVar[tuple[str, ...]] = ("lo", "hi")  # what the tier's resident index keeps per page
    scorer: Method = field(default_factory=lambda: default_scorer("streaming"))
    page: int = 64
    select: int = 1024
    bits: int = 16  # how the slow tier stores keys and values: 16 as the model holds them, or 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in (8, 16):
            raise ValueError(f"{self.name}: bits must be 16 (as the model holds them) or 8, got {self.bits}")
        if self.page < 1:
            raise ValueError(f"{self.name}: page must be >= 1 token, got {self.page}")
        if self.select < self.page:
            raise ValueError(f"{self.name}: select must be at least one page ({self.page} tokens), got {self.select}")

    def score(self, obs: Observation) -> torch.Tensor:
        """(b, h, t) what stays resident: the wrapped scorer's scores."""
        return self.scorer.score(obs)

    def rank(self, queries: torch.Tensor, index: dict[str, torch.Tensor]) -> torch.Tensor:
        """(b, h, P) how much each page of the tier matters to queries (b, h, g*q, d) (the g query
        heads of each KV head and the call's q queries), from the index: each of `summaries`
        (b, h, P, d) ("lo", "hi": the keys' channel-wise minimum and maximum; "mean")."""
        raise NotImplementedError

    def choose(self, ranks: torch.Tensor, k: int) -> torch.Tensor:
        """(b, h, k) the pages to bring back, in page order, from ranks (b, h, P) (-inf: a page
        the head has not filled); an index >= P is no page. Default: the k best."""
        return torch.sort(ranks.topk(k, dim=-1).indices, dim=-1).values

    def arrange(self, keys: torch.Tensor, moved: torch.Tensor) -> torch.Tensor | None:
        """(b, h, t) the order in which the tokens `moved` (b, h, t) of keys (b, h, t, d) fill the
        tier's pages (None: by slot, so a page is a run of the sequence)."""
        return None


def resident_share(
    keep: torch.Tensor, room: torch.Tensor, page: int, select: int, token_bytes: int, index_bytes: int, layers: int
) -> tuple[torch.Tensor, int]:
    """(resident (b, h), pages): how many tokens a head of a layer keeps resident and how many
    pages it brings back per attention call, when the budget gives it `keep` (b, h) tokens of
    `token_bytes` each and at most `room` (b,) tokens can move to the tier.

    The tier's index costs `index_bytes` per page (ceil(room / page) pages at most). The pages
    brought back live for one layer's attention at a time, so each of the `layers` layers pays
    1/layers of them; they get at most half of what the index leaves, and `select` tokens at most.
    """
    index = torch.ceil(torch.ceil(room.double() / page) * index_bytes / token_bytes).long() + 1  # (b,)
    # (+1: the tier's per-head entry count)
    left = keep - index[:, None]
    spare = int(left.min()) // 2 if left.numel() else 0
    fetched = min(select, max(spare, 0) * layers) // page * page  # tokens per head per call
    resident = left - math.ceil(fetched / layers)
    return resident.clamp(min=1), fetched // page
