"""`tokenselect`: TokenSelect (#56), token-level selection by per-head soft voting."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstack.methods.evict.quest_pages import criticality
from kvstack.methods.registry import register
from kvstack.methods.retrieve.base import TokenRetriever, top_entries


@register
@dataclass
class TokenSelect(TokenRetriever):
    """TokenSelect measures each cached token's criticality per head by q . k and selects tokens,
    not pages, by per-head soft voting: each head's scores become a softmax over the tokens, and
    the heads' softmaxes are summed, so a head with a sharp peak votes with weight and a flat
    one barely, where summing raw logits would let one head's scale decide. The `tokens` most
    voted are attended. Its candidates here come from the tier: Quest's bound ranks pages and
    `select` tokens of pages come back (the tier cannot score tokens it does not hold), then the
    vote picks `tokens` of them.

    Deviations: the vote is over a KV head's query heads and the call's queries (one selection per
    KV head, as kvstack shares a KV head's entries; TokenSelect shares one over a layer's heads);
    its Selection Cache (reusing a selection while consecutive queries stay alike) is not built;
    256 tokens of the 1,024 brought back, not 2k of 128k.

    Shapes: queries (b, h, g*q, d), index (b, h, P, d) -> (b, h, P); keys (b, h, n, d) -> (b, h, n).
    """

    name = "tokenselect"
    paper = "TokenSelect: Efficient Long-Context Inference via Dynamic Token-Level KV Cache Selection (#56)"

    def rank(
        self, queries: torch.Tensor, index: dict[str, torch.Tensor], text: torch.Tensor | None = None
    ) -> torch.Tensor:
        return criticality(queries.float(), index["lo"].float(), index["hi"].float()).amax(dim=2)

    def refine(self, queries: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        return top_entries(soft_votes(queries, keys, held), held, self.tokens)


def soft_votes(queries: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """(b, h, n) each entry's votes: softmax over the held entries of q . k / sqrt(d) for each of
    the queries (b, h, m, d), summed over them (keys (b, h, n, d), held (b, h, n))."""
    logits = queries.float() @ keys.float().transpose(-1, -2) / math.sqrt(queries.shape[-1])  # (b, h, m, n)
    logits = logits.masked_fill(~held[:, :, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=2)
