"""`sentence`: SentenceKV (arXiv 2504.00970): keep whole sentences, ranked by their tokens' scores."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.methods.base import Observation
from kvstack.methods.evict.chunk import pool
from kvstack.methods.evict.rescore import Rescorer
from kvstack.methods.registry import register

# a token whose text ends a sentence: . ! ? (then closing quotes or brackets) at its end, or a line break
END = re.compile(r"([.!?][\"')\]]*\s*$)|\n")
TABLE = "_kvstack_sentence_ends"  # memo on the model: (vocab,) bool


def ends_sentence(text: str) -> bool:
    """True when a token whose text is `text` ends a sentence (". ", "?", ".\\n", a line break)."""
    return bool(END.search(text))


def sentence_table(model: Any) -> torch.Tensor:
    """(vocab,) True for the ids whose text ends a sentence, built once per model from its tokenizer
    (the loaded model's `_kvstack_token_texts`); none end one for a model without a tokenizer."""
    table = getattr(model, TABLE, None)
    if table is None:
        vocab = model.config.get_text_config().vocab_size
        texts = getattr(model, "_kvstack_token_texts", lambda: [])()
        table = torch.zeros(max(vocab, len(texts)), dtype=torch.bool)
        table[: len(texts)] = torch.tensor([ends_sentence(t) for t in texts], dtype=torch.bool)
        setattr(model, TABLE, table)
    return table


@register
@dataclass
class Sentence(Rescorer):
    """SentenceKV's unit of memory: a sentence. A fact spans a sentence, so keep or drop sentences
    whole: each token's score under the wrapped `scorer` is replaced by its sentence's mean
    (`chunk.pool`), sentences are kept best first, and a sentence the budget cuts keeps its best
    tokens. Sentence ends are tokens whose text ends in . ! ? or holds a line break, marked as
    the tokens come in (`tokens_in`), so decoded sentences are units too.

    Deviations: SentenceKV keeps a sentence-level semantic vector on the GPU and retrieves whole
    sentences by the query at decode time (a retrieval tier, issue 27); here the sentence is only
    the unit of eviction under any scorer (`sentence(kvzip)`), as ChunkKV's chunk is (`chunk`).
    A sentence longer than `longest` tokens is split into pieces of that length, so a page with
    no full stop (code, a table) is not one unit.

    Shapes: sentence index (b, h, t) (from `Observation.sentence`) -> groups; scores (b, h, t) -> pooled.
    """

    name = "sentence"
    family = "evict"
    paper = "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching (arXiv 2504.00970)"
    longest: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.longest < 1:
            raise ValueError(f"sentence: longest must be >= 1 token, got {self.longest}")

    def tokens_in(self, runner: Any, ids: torch.Tensor, mask: torch.Tensor) -> None:
        table = sentence_table(runner.model).to(ids.device)
        ends = table[ids.clamp(0, table.shape[0] - 1)] & mask.bool()
        runner.cache.seq.mark_ends(ends, runner.cache.get_seq_length())

    def score(self, obs: Observation) -> torch.Tensor:
        piece = obs.positions - first_position(obs.sentence, obs.positions, obs.valid)
        groups = obs.sentence * (1 + obs.positions.amax().clamp(min=0) // self.longest) + piece // self.longest
        groups = torch.where(obs.valid, groups, torch.zeros_like(groups))  # padding joins no group's mean
        return pool(self.scorer.score(obs), groups, obs.valid)


def first_position(sentence: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(b, h, t) the position of the first held token of each token's sentence."""
    big = torch.iinfo(torch.long).max
    size = int(sentence.max()) + 1 if sentence.numel() else 1
    pos = torch.where(valid, positions, torch.full_like(positions, big))
    first = torch.full((*sentence.shape[:-1], size), big, dtype=torch.long, device=sentence.device)
    first = first.scatter_reduce(-1, sentence, pos, reduce="amin")
    return first.gather(-1, sentence).clamp(max=positions.amax().clamp(min=0))
