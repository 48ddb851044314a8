"""`s3`: S3-Attention (#59), retrieval of evidence spans by what the recent text names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvstack.errors import UserError
from kvstack.methods.evict.quest_pages import criticality
from kvstack.methods.registry import register
from kvstack.methods.retrieve.base import Retriever


@register
@dataclass
class S3(Retriever):
    """S3-Attention discards the KV cache after one streaming scan and keeps a CPU inverted index
    from features to the token spans that hold them; at generation time the features of the
    current text retrieve compact evidence spans, scored by feature co-activation fused with
    BM25 for exact lexical matches. Here the features are the tokens themselves, the paper's
    BM25 half: each page of the slow tier is a document of its tokens' ids (the tier's index
    keeps each page's slots, the cache each slot's token id), the query is the last `window`
    tokens up to the call's last query, and pages rank by Okapi BM25 (k1 = 1.2, b = 0.75, idf
    over the head's pages). A page right after a match ranks as the match (`reach` pages), since
    the fact follows the words that name it: a page boundary may cut "the number for X is:" from
    its digits. With `fuse`, the paper's hybrid: the lexical ranking is fused with one from the
    model's own projections, Quest's bound of the call's queries against each page's key
    minimum and maximum (the index then keeps those too), by reciprocal rank fusion
    (1 / (60 + rank) summed, Cormack et al. 2009).

    Deviations: no sparse autoencoder (it must be trained per model; the lexical half needs
    none; the fused signal is Quest's bound, not SAE feature co-activation); spans are the tier's
    pages, read back as keys and values rather than re-encoded text; unfused, every layer and
    head ranks by the same text, so they bring back the same pages.

    Shapes: text (b, s) ids, index "slots" (b, h, P, page) -> (b, h, P).
    """

    name = "s3"
    paper = "S3-Attention (#59)"
    reads_text: ClassVar[bool] = True
    window: int = 32
    reach: int = 1
    fuse: bool = False
    k1: ClassVar[float] = 1.2
    b: ClassVar[float] = 0.75

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"{self.name}: window must be >= 1 token (the query text), got {self.window}")
        if self.reach < 0:
            raise ValueError(f"{self.name}: reach must be >= 0 pages after a match, got {self.reach}")

    @property
    def summaries(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("slots", "lo", "hi") if self.fuse else ("slots",)

    def tokens_in(self, runner: Any, ids: torch.Tensor, mask: torch.Tensor) -> None:
        runner.cache.seq.record_ids(torch.where(mask.bool(), ids, -1), runner.cache.get_seq_length())

    def rank(
        self, queries: torch.Tensor, index: dict[str, torch.Tensor], text: torch.Tensor | None = None
    ) -> torch.Tensor:
        if text is None:
            raise UserError(
                f"{self.name} ranks pages by the tokens' text, which kvstack's own loop records as tokens come "
                "in: use kvstack.generate / `kvstack generate` (model.generate cannot record them)"
            )
        slots = index["slots"].long()
        words = page_words(text, slots)
        ranks = bm25(words, last_words(text, self.window), self.k1, self.b)
        for _ in range(self.reach):  # the page after a match ranks as the match
            after = torch.cat([ranks[..., :1], ranks[..., :-1]], dim=-1)
            ranks = torch.maximum(ranks, after)
        if not self.fuse:
            return ranks
        bound = criticality(queries.float(), index["lo"].float(), index["hi"].float()).amax(dim=2)
        return reciprocal_rank(ranks) + reciprocal_rank(bound)


def reciprocal_rank(scores: torch.Tensor, k: int = 60) -> torch.Tensor:
    """(..., P) 1 / (k + r) for each page's rank r (1 = the best; ties share the better rank)
    under scores (..., P): what reciprocal rank fusion sums over rankings."""
    better = (scores[..., None, :] > scores[..., :, None]).sum(-1)  # pages scoring above each
    return 1.0 / (k + 1 + better.float())


def page_words(text: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(b, h, P, n) the token id at each of slots (b, h, P, n) (-1 where a slot is empty or its
    id unknown), from text (b, s) the ids of the sequence's slots."""
    b, h, p, n = slots.shape
    if text.shape[1] == 0:
        return torch.full_like(slots, -1)
    at = slots.clamp(min=0, max=text.shape[1] - 1).reshape(b, h * p * n)
    words = torch.gather(text.long(), 1, at).reshape(b, h, p, n)
    return words.masked_fill((slots < 0) | (slots >= text.shape[1]), -1)


def last_words(text: torch.Tensor, n: int) -> torch.Tensor:
    """(b, n) the ids of each row's last n known tokens in text (b, s) (-1: unknown or padding,
    skipped; -1 fills a row with fewer), so padding between a context and its question does not
    shorten the query."""
    place = torch.where(text >= 0, torch.arange(text.shape[1], device=text.device), -1)
    last = place.topk(min(n, text.shape[1]), dim=-1).values  # (b, n') places, -1 where none
    words = torch.gather(text.long(), 1, last.clamp(min=0))
    return words.masked_fill(last < 0, -1)


def bm25(words: torch.Tensor, query: torch.Tensor, k1: float, b: float) -> torch.Tensor:
    """(b, h, P) Okapi BM25 of each page (words (b, h, P, n), -1 no word) for the query's
    distinct words (b, w) (-1 none): sum over them of idf * tf (k1 + 1) / (tf + k1 (1 - b + b len / avg len)),
    idf = ln(1 + (N - df + 0.5) / (df + 0.5)) over the N pages holding a word."""
    words_sorted = query.sort(-1).values  # (b, w): a word's matches land on its first place
    first = torch.ones_like(words_sorted, dtype=torch.bool)
    first[:, 1:] = words_sorted[:, 1:] != words_sorted[:, :-1]
    distinct = first & (words_sorted >= 0)
    bsz, h, p, n = words.shape
    flat = words.reshape(bsz, h * p * n)
    place = torch.searchsorted(words_sorted, flat).clamp(max=words_sorted.shape[1] - 1)  # (b, h*P*n)
    hit = (torch.gather(words_sorted, 1, place) == flat) & (flat >= 0)
    tf = torch.zeros(bsz, h, p, words_sorted.shape[1], device=words.device)  # (b, h, P, w)
    tf.scatter_add_(-1, place.view(bsz, h, p, n), hit.view(bsz, h, p, n).float())
    length = (words >= 0).sum(-1).float()  # (b, h, P)
    pages = (length > 0).sum(-1, keepdim=True).float()  # (b, h, 1)
    df = (tf > 0).sum(2).float()  # (b, h, w)
    idf = torch.log1p((pages - df + 0.5) / (df + 0.5))  # (b, h, w)
    avg = length.sum(-1, keepdim=True) / pages.clamp(min=1)
    norm = k1 * (1 - b + b * length / avg.clamp(min=1))  # (b, h, P)
    per_word = idf[:, :, None, :] * tf * (k1 + 1) / (tf + norm[..., None])
    return (per_word * distinct[:, None, None, :]).sum(-1)
