"""The one-call API: a loaded model, text in, answers and measurements out."""

from __future__ import annotations

from kvstack.cache.budget import Budget
from kvstack.generate import Result, generate_ids, warm_up
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
) -> Result:
    """Answer each question about its context, compressing the KV cache with `method` under `budget`
    (with `prefill_chunk`, the context goes in chunks of that many tokens, compressed between them)."""
    if warm:
        warm_up(lm.model)
    prompts = [build_prompt(lm, c, q, answer_prefix) for c, q in zip(contexts, questions, strict=True)]
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids, m = generate_ids(
        lm.model, prompts, method, budget, query_agnostic, max_new_tokens, eos_ids(lm), pad, prefill_chunk
    )
    answers = [lm.tokenizer.decode(x, skip_special_tokens=True).strip() for x in ids]
    return Result(
        answers=answers,
        new_tokens=ids,
        context_tokens=[len(p.context) for p in prompts],
        prompt_tokens=[len(p.context) + len(p.question) for p in prompts],
        **m,
    )
