"""The one-call API: a loaded model, text in, answers and measurements out."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.cache.saved import load
from kvstack.generate import (
    Prompt,
    Result,
    check_lengths,
    compress_ids,
    generate_from,
    generate_ids,
    warm_up,
)
from kvstack.models.loading import LoadedModel
from kvstack.models.prompts import build_prompt, eos_ids
from kvstack.stack import Stack


def answer(
    lm: LoadedModel,
    contexts: list[str],
    questions: list[str],
    method: str | Stack = "full",
    budget: str | float | Budget = 1.0,
    query_agnostic: bool = False,
    max_new_tokens: int = 32,
    answer_prefix: str = "",
    warm: bool = True,
    prefill_chunk: int | None = None,
    decode_on: str = "cache",
) -> Result:
    """Answer each question about its context, compressing the KV cache with `method` under `budget`
    (with `prefill_chunk`, the context goes in chunks of that many tokens, compressed between them;
    `decode_on="compiled"` decodes an eviction stack on fixed-shape storage under torch.compile)."""
    if warm:
        warm_up(lm.model)
    prompts = [build_prompt(lm, c, q, answer_prefix) for c, q in zip(contexts, questions, strict=True)]
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids, m = generate_ids(
        lm.model, prompts, method, budget, query_agnostic, max_new_tokens, eos_ids(lm), pad, prefill_chunk, decode_on
    )
    answers = [lm.tokenizer.decode(x, skip_special_tokens=True).strip() for x in ids]
    return Result(
        answers=answers,
        new_tokens=ids,
        context_tokens=[len(p.context) for p in prompts],
        prompt_tokens=[len(p.context) + len(p.question) for p in prompts],
        **m,
    )


def context_ids(lm: LoadedModel, context: str) -> list[int]:
    """The context's token ids as a prompt with a question after it starts (chat template included),
    the part a query-agnostic cache holds."""
    return build_prompt(lm, context, "?").context


def question_ids(lm: LoadedModel, question: str, answer_prefix: str = "") -> list[int]:
    """The question's token ids as they follow a context (the chat turn's end and the answer's start)."""
    return build_prompt(lm, "?", question, answer_prefix).question


def text_sha256(ids: list[int]) -> str:
    """The hash naming a context by its tokens (a saved cache's `text_sha256`, a prefix store's key)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def compress(
    lm: LoadedModel,
    context: str,
    method: str | Stack = "full",
    budget: str | float | Budget = 1.0,
    prefill_chunk: int | None = None,
    warm: bool = True,
) -> KVCache:
    """A cache holding `context` compressed before any question (query-agnostic), ready to save
    (`cache.save(path)`) or to answer from (`answer_cached`)."""
    if warm:
        warm_up(lm.model)
    return compress_ids(lm.model, context_ids(lm, context), method, budget, prefill_chunk)


def save_cache(cache: KVCache, path: str | Path, lm: LoadedModel | None = None, context: str | None = None) -> dict:
    """Write `cache` to `path`; with `lm` and `context`, the header names the text it holds."""
    digest = text_sha256(context_ids(lm, context)) if lm is not None and context is not None else None
    return cache.save(path, digest, cache.last_logits)


def load_cache(lm: LoadedModel | Any, path: str | Path) -> KVCache:
    """A cache saved with `KVCache.save` (or `kvstack cache save`), loaded onto `lm`'s model: it
    answers exactly as the saved one would (same tokens, logits and bytes)."""
    model = lm.model if isinstance(lm, LoadedModel) else lm
    return load(model, path)[0]


def answer_cached(
    lm: LoadedModel,
    cache: KVCache,
    questions: list[str],
    max_new_tokens: int = 32,
    answer_prefix: str = "",
) -> Result:
    """Answer one question per sequence of a cache that holds compressed contexts (from `compress`,
    `load_cache` or a `PrefixStore`); the cache takes the questions and answers (use it once)."""
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    asked = [question_ids(lm, q, answer_prefix) for q in questions]
    held = cache.seq.real_counts(cache.layers[0].seen, cache.layers[0].batch).tolist()
    check_lengths(lm.model, [Prompt([0] * n, q) for n, q in zip(held, asked, strict=True)], max_new_tokens)
    ids, m = generate_from(lm.model, cache, asked, None, max_new_tokens, eos_ids(lm), pad)
    return Result(
        answers=[lm.tokenizer.decode(x, skip_special_tokens=True).strip() for x in ids],
        new_tokens=ids,
        context_tokens=held,
        prompt_tokens=[n + len(q) for n, q in zip(held, asked, strict=True)],
        **m,
    )
