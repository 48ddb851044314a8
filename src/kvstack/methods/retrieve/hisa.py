"""`hisa`: HISA (#65), hierarchical indexed sparse attention: pages by their mean key, then tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.methods.registry import register
from kvstack.methods.retrieve.base import TokenRetriever, top_entries


@register
@dataclass
class Hisa(TokenRetriever):
    """HISA replaces a flat token indexer (DeepSeek Sparse Attention scores every past token for
    each query) by two stages: a block-level coarse filter scores pooled block representatives
    and keeps the best blocks, then the token-level indexer scores only those blocks' tokens and
    keeps its top k, the same sparsity pattern at a fraction of the scan. Here the blocks are the
    tier's pages, pooled as their mean key (resident); a page ranks by q . mean, and `select`
    tokens of pages come back; then the `tokens` entries with the largest q . k among them are
    attended.

    Deviations: DSA's indexer is a trained scorer with its own heads; without it the model's own
    q . k scores tokens, the largest over a KV head's query heads and the call's queries (one
    selection per KV head and call, where DSA selects per query); k is 256 of the 1,024 brought
    back, not DSA's 2,048 of 128k.

    Shapes: queries (b, h, g*q, d), means (b, h, P, d) -> (b, h, P); keys (b, h, n, d) -> (b, h, n).
    """

    name = "hisa"
    paper = "HISA: Hierarchical Indexed Sparse Attention (#65)"
    summaries: ClassVar[tuple[str, ...]] = ("mean",)

    def rank(
        self, queries: torch.Tensor, index: dict[str, torch.Tensor], text: torch.Tensor | None = None
    ) -> torch.Tensor:
        return (queries.float() @ index["mean"].float().transpose(-1, -2)).amax(dim=2)

    def refine(self, queries: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        logits = (queries.float() @ keys.float().transpose(-1, -2)).amax(dim=2)  # (b, h, n)
        return top_entries(logits, held, self.tokens)
