"""Base of retrieval methods: what stays resident, what moves to the slow tier, what comes back.

A retriever plays two parts. As a scorer it says which tokens stay resident (its `scorer`, by
default StreamingLLM's sinks and recent window); every other token moves to the layer's slow
tier (`kvstack.cache.tier`) instead of being dropped. Before each attention call it ranks the
tier's pages by the current queries (`rank`, the paper's part) and the best come back for that
call only. The byte budget pays for what is resident: the tokens held, the tier's page index,
and the pages brought back for one layer at a time (`resident_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvstack.cache.stores import STORES
from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Method, Observation
from kvstack.methods.evict.rescore import Rescorer


@dataclass
class Retriever(Rescorer):
    """A method that moves the tokens its `scorer` does not keep resident to a slow tier (stored
    at `bits`: 8 halves what is written and read back, with a scale per token; in `store`) and retrieves
    `select` of them (whole pages of `page` tokens) per head at each attention call.
    It evicts at its own cadence (a block per head while decoding), not its scorer's."""

    role: ClassVar[str] = "retriever"
    family: ClassVar[str] = "retrieve"
    cadence_from_inner: ClassVar[bool] = False
    summaries: ClassVar[tuple[str, ...]] = ("lo", "hi")  # what the resident index keeps per page (tier.SUMMARIES)
    reads_text: ClassVar[bool] = False  # ranks by the token ids the cache records (their bytes are resident)
    remembers: ClassVar[bool] = False  # keeps its last choice and the query that made it (`stale`), resident
    scorer: Method = field(default_factory=lambda: default_scorer("streaming"))
    page: int = 64
    select: int = 1024
    bits: int = 16  # how the slow tier stores keys and values: 16 as the model holds them, or 8
    store: str = (
        "auto"  # where the slow tier lives: "disk" (a file), "host" (memory, pinned on a GPU); auto: host on a GPU
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in (8, 16):
            raise ValueError(f"{self.name}: bits must be 16 (as the model holds them) or 8, got {self.bits}")
        if self.store not in STORES:
            raise ValueError(f"{self.name}: store must be one of {', '.join(STORES)}, got {self.store!r}")
        if self.page < 1:
            raise ValueError(f"{self.name}: page must be >= 1 token, got {self.page}")
        if self.select < self.page:
            raise ValueError(f"{self.name}: select must be at least one page ({self.page} tokens), got {self.select}")

    def score(self, obs: Observation) -> torch.Tensor:
        """(b, h, t) what stays resident: the wrapped scorer's scores."""
        return self.scorer.score(obs)

    def rank(
        self, queries: torch.Tensor, index: dict[str, torch.Tensor], text: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(b, h, P) how much each page of the tier matters to queries (b, h, g*q, d) (the g query
        heads of each KV head and the call's q queries), from the index: each of `summaries`
        (b, h, P, d) ("lo", "hi": the keys' channel-wise minimum and maximum; "mean"; or
        (b, h, P, page) "slots"), and, for a retriever that records them, `text` (b, s): the token
        id of each slot up to the call's last query (-1 unknown)."""
        raise NotImplementedError

    def choose(self, ranks: torch.Tensor, k: int) -> torch.Tensor:
        """(b, h, k) the pages to bring back, in page order, from ranks (b, h, P) (-inf: a page
        the head has not filled); an index >= P is no page. Default: the k best, ties to the
        earlier page (a stable order: a row chooses alike alone or in a batch)."""
        best = torch.sort(ranks, dim=-1, descending=True, stable=True).indices[..., :k]
        return torch.sort(best, dim=-1).values

    def stale(self, queries: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """(b, h) True where a head ranks its pages afresh for queries (b, h, g, d) of one decoding
        step, given anchor (b, h, d): the mean query of the call that made its last choice (a
        retriever that `remembers`; the others rank at every call)."""
        return torch.ones(queries.shape[:2], dtype=torch.bool, device=queries.device)

    def lead(self, ranks: torch.Tensor, table: Any, layer: int) -> torch.Tensor:
        """(b, h, P) the ranks each head of `layer` chooses its pages by, from every head's own
        ranks (b, h, P) and what the method loaded from the model (`Method.load`: None by
        default): its own (the default), or another head's."""
        return ranks

    def refine(self, queries: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor | None:
        """(b, h, n) which of the n entries brought back (keys (b, h, n, d); `held` False where an
        entry is empty) the call's queries (b, h, g*q, d) attend: a token-level selection inside
        the pages (None: all of them, the default)."""
        return None

    def arrange(
        self, keys: torch.Tensor, moved: torch.Tensor, prompt: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """(b, h, t) the order in which the tokens `moved` (b, h, t) of keys (b, h, t, d) fill the
        tier's pages (None: by slot, so a page is a run of the sequence); `prompt` (b, h, t) is
        True for tokens that came with the prompt (None: unknown)."""
        return None


@dataclass
class TokenRetriever(Retriever):
    """A retriever that, inside the pages it brought back, attends only the `tokens` entries its
    `refine` picks (HISA's token indexer, TokenSelect's vote)."""

    tokens: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokens < 1:
            raise ValueError(f"{self.name}: tokens must be >= 1 (attended per call), got {self.tokens}")


def resident_share(
    keep: torch.Tensor, room: torch.Tensor, page: int, select: int, token_bytes: int, index_bytes: int, layers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(resident (b, h), pages (b,)): how many tokens a head of a layer keeps resident and how
    many pages each sequence's heads bring back per attention call, when the budget gives it
    `keep` (b, h) tokens of `token_bytes` each and at most `room` (b,) tokens can move to the tier.

    The tier's index costs `index_bytes` per page (ceil(room / page) pages at most). The pages
    brought back live for one layer's attention at a time, so each of the `layers` layers pays
    1/layers of them; they get at most half of what the index leaves a sequence's smallest head,
    and `select` tokens at most. Each sequence on its own: a row shares alike alone or in a batch.
    """
    index = torch.ceil(torch.ceil(room.double() / page) * index_bytes / token_bytes).long() + 1  # (b,)
    # (+1: the tier's per-head entry count)
    left = keep - index[:, None]
    spare = (left.amin(-1) // 2).clamp(min=0) if left.numel() else torch.zeros_like(index)  # (b,)
    fetched = torch.clamp(spare * layers, max=select) // page * page  # tokens per head per call
    resident = left - torch.ceil(fetched / layers).long()[:, None]
    return resident.clamp(min=1), fetched // page


def top_entries(scores: torch.Tensor, held: torch.Tensor, k: int) -> torch.Tensor:
    """(b, h, n) True for the k best-scoring held entries of scores (b, h, n) per head (all held
    ones when fewer), ties to the earlier entry."""
    scores = scores.masked_fill(~held, float("-inf"))
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros_like(held).scatter_(-1, best, True)
    return chosen & held
