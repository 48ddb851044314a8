"""kvstack as an lm-evaluation-harness model (`kvstack`): users' lm-eval tasks run with the KV cache
compressed by any stack at any budget.

Each request's context is prefilled and compressed before its continuation is seen (query-agnostic,
as a reused context would be): `loglikelihood` then scores the continuation through the compressed
cache, `generate_until` decodes from it, and `loglikelihood_rolling` reads the text in chunks of
`chunk` tokens, compressing between them, scoring each chunk's tokens on the cache as it stands.
At budget 1.0 the scores equal transformers' (tested against lm-eval's own `hf` model).
Registered on import: `import kvstack.harness`, then `lm_eval.simple_evaluate(model="kvstack",
model_args="model=smollm2-135m,method=snapkv,budget=0.25", tasks=[...])`, or `kvstack eval`.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.generate import Prompt, Runner, check_config, check_lengths, generate_ids, left_pad
from kvstack.models.loading import LoadedModel, load
from kvstack.models.prompts import eos_ids
from kvstack.stack import Stack


@register_model("kvstack")
class KVStackLM(LM):
    """`model` (a registered name or folder) under `method` at `budget`; `max_gen_toks` when a task
    names none; `chunk`: tokens per step of `loglikelihood_rolling`. `kv_ratios` collects each
    request's measured bytes over a full cache's."""

    def __init__(
        self,
        model: str | LoadedModel = "smollm2-135m",
        method: str = "full",
        budget: str | float = 1.0,
        max_gen_toks: int = 256,
        chunk: int = 512,
        prefill_chunk: int | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.stack, self.budget = Stack.parse(str(method)), Budget.parse(budget)
        self.stack.check_budget(self.budget)
        self.lm = model if isinstance(model, LoadedModel) else load(str(model))
        self.max_gen_toks, self.chunk = int(max_gen_toks), int(chunk)
        self.prefill_chunk = int(prefill_chunk) if prefill_chunk else None
        self.kv_ratios: list[float] = []

    # ---- tokens ----

    def _encode(self, text: str) -> list[int]:
        return self.lm.tokenizer.encode(text, add_special_tokens=False)

    def _prefix(self) -> list[int]:
        """What an empty context starts from: the model's BOS, else its EOS (as lm-eval's `hf` does)."""
        tok = self.lm.tokenizer
        first = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        return [first] if first is not None else []

    def _context(self, text: str) -> list[int]:
        ids = self._encode(text)
        if not ids or (self.lm.add_bos and self.lm.tokenizer.bos_token_id is not None):
            ids = self._prefix() + ids
        return ids

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids), split where the whole text's tokens part (lm-eval's way:
        a trailing space moves to the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self._context(context + continuation), self._context(context)
        return ctx, whole[len(ctx) :]

    # ---- the three request types ----

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | compressed context), whether greedy decoding gives it) per request."""
        out = []
        for request in tqdm(requests, desc="kvstack loglikelihood", disable=disable_tqdm):
            context, continuation = request.args
            ctx, cont = self._split(context, continuation)
            runner = self._compressed(ctx, len(cont))
            logits = runner.last_logits  # (1, vocab): predicts the continuation's first token
            assert logits is not None
            if len(cont) > 1:
                rest = runner.forward(
                    torch.tensor([cont[:-1]]),
                    torch.ones(1, len(cont) - 1, dtype=torch.long),
                    torch.arange(len(cont) - 1),
                )[0]
                logits = torch.cat([logits, rest])
            out.append(_score(logits, cont))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """log p(text) per request, read `chunk` tokens at a time on a cache compressed between chunks."""
        out = []
        for request in tqdm(requests, desc="kvstack loglikelihood_rolling", disable=disable_tqdm):
            ids = self._prefix() + self._encode(request.args[0])
            check_lengths(self.lm.model, [Prompt(ids, [])], 0)
            runner = Runner(self.lm.model, KVCache(self.lm.model, self.stack, self.budget))
            total = 0.0
            for start in range(0, len(ids) - 1, self.chunk):
                piece = ids[start : min(start + self.chunk, len(ids) - 1)]
                logits = runner.forward(
                    torch.tensor([piece]), torch.ones(1, len(piece), dtype=torch.long), torch.arange(len(piece))
                )[0]
                total += _score(logits, ids[start + 1 : start + 1 + len(piece)])[0]
            self.kv_ratios.append(_ratio(runner.cache))
            out.append(total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy answers from the compressed context, cut at the task's first stop string."""
        out = []
        eos, pad = eos_ids(self.lm), self.lm.tokenizer.pad_token_id or 0
        for request in tqdm(requests, desc="kvstack generate_until", disable=disable_tqdm):
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids, measured = generate_ids(
                self.lm.model,
                [Prompt(self._context(context), [])],
                self.stack,
                self.budget,
                max_new_tokens=int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                eos_ids=eos,
                pad_id=pad,
                prefill_chunk=self.prefill_chunk,
            )
            self.kv_ratios.append(measured["kv_ratio"])
            text = self.lm.tokenizer.decode(ids[0], skip_special_tokens=True)
            cuts = [i for i in (text.find(s) for s in until if s) if i >= 0]
            out.append(text[: min(cuts)] if cuts else text)
        return out

    def _compressed(self, ctx: list[int], new_tokens: int) -> Runner:
        """A runner whose cache holds `ctx` compressed (the continuation not yet seen)."""
        prompts = [Prompt(ctx, [])]
        check_lengths(self.lm.model, prompts, new_tokens)
        check_config(prompts, self.stack, self.budget)
        runner = Runner(self.lm.model, KVCache(self.lm.model, self.stack, self.budget))
        runner.prefill(*left_pad([ctx], 0), self.prefill_chunk)
        self.kv_ratios.append(_ratio(runner.cache))
        return runner


def _score(logits: torch.Tensor, targets: list[int]) -> tuple[float, bool]:
    """(sum of log p(targets), whether each target is the argmax) from logits (len(targets), vocab)."""
    logp = torch.log_softmax(logits.float(), -1)
    wanted = torch.tensor(targets, device=logp.device)
    return float(logp.gather(-1, wanted[:, None]).sum()), bool((logp.argmax(-1) == wanted).all())


def _ratio(cache: KVCache) -> float:
    full = cache.full_nbytes()
    return cache.nbytes() / full if full else 1.0
