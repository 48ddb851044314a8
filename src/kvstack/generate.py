"""Prefill -> compress -> decode, greedy, batched, with the timings and bytes a user asks for.

Two modes. Query-aware (default): context and question are prefilled together, then
compressed, so observation windows see the question. Query-agnostic: the context is
prefilled and compressed before the question is seen; the question is then appended
uncompressed (exempt), so one compressed context can serve many questions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.cache.slab_cache import SlabCache, check_slab
from kvstack.cache.statistics import PROMPT_PASSES
from kvstack.errors import UserError
from kvstack.methods.base import Stage
from kvstack.methods.registry import provider
from kvstack.stack import Stack
from kvstack.timing import now


@dataclass
class Prompt:
    """Token ids of one request, split where compression happens in query-agnostic mode."""

    context: list[int]
    question: list[int]


@dataclass
class Result:
    """What one batched generation produced and measured."""

    answers: list[str]
    new_tokens: list[list[int]]
    context_tokens: list[int]
    prompt_tokens: list[int]
    kv_bytes: int  # held after the prompt was prefilled and compressed, read off the tensors
    kv_bytes_full: int  # a full cache for the same tokens
    kv_ratio: float
    kv_bytes_end: int
    peak_kv_bytes: int  # the most held at once while the prompt went in (chunked prefill keeps it low)
    kv_bytes_full_end: int
    prefill_s: float
    compress_s: float
    decode_s: float
    decode_tokens_per_s: float
    method: str
    budget: str
    mode: str
    stats: list[dict[str, Any]] = field(default_factory=list, repr=False)
    offloaded_bytes: int = 0  # a retriever's slow tier on disk at the end, outside kv_bytes
    fetched_bytes_per_step: float = 0.0  # read back from the slow tier per decoding step
    fetch_s_per_step: float = 0.0  # ranking and reading those pages, per decoding step
    decode_on: str = "cache"  # the KVCache, or a slab (`SlabRunner`), eager or compiled
    compile_s: float = 0.0  # compiled: the first decoding step (trace and compilation), outside decode_s

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("stats")
        return out


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (b, max_len), rows right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
    return ids, mask


class Runner:
    """Feeds chunks to the model, keeping the 2D mask and positions of the whole sequence, and
    calls the stages' lifecycle hooks (`Stage.prompt_done`, `Stage.step_done`) after each chunk.

    `hooks`: the stages whose hooks run; by default every stage of the cache's stack (a cache
    observing for other stacks' forks passes theirs). A statistic the cache observes that a pass
    over the prompt records (`cache.statistics.PROMPT_PASSES`) adds its provider if none is there."""

    def __init__(self, model: Any, cache: KVCache, hooks: list[Stage] | None = None) -> None:
        self.model, self.cache = model, cache
        self.hooks = list(cache.stack.parts if hooks is None else hooks)
        provided = frozenset().union(*(stage.provides for stage in self.hooks))
        self.hooks += [provider(name) for name in sorted(cache.needs & PROMPT_PASSES - provided)]
        self.mask: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None
        self.rows: list[list[int]] = []  # each sequence's real tokens so far, kept when a prompt pass re-reads them

    def fork(self, stack: Stack | str, budget: Budget | str | float) -> Runner:
        """A runner over a compressed copy of this runner's cache, at the same point of the sequence."""
        runner = Runner(self.model, self.cache.fork(stack, budget))
        runner.mask, runner.last_logits = self.mask, self.last_logits
        runner.rows = [list(row) for row in self.rows]
        return runner

    def forward_rows(self, rows: list[list[int]], pad_id: int = 0) -> torch.Tensor:
        """Run one chunk given as token ids per sequence (left-padded to the longest); last logits (b, vocab)."""
        return self.forward(*left_pad(rows, pad_id))

    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        chunk: int | None = None,
        question: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run a prompt (b, n), in chunks of `chunk` tokens when given: the cache compresses after
        each chunk, so it never holds much more than its budget plus one chunk. Last logits (b, vocab).

        question: the prompt's last tokens (ids, mask (b, m)), when they are a question: a stack that
        scores by observed queries (SnapKV) then scores each earlier chunk by the question, run
        after the chunk on a probe that stores nothing (`probe`), not by the chunk's own end."""
        n = ids.shape[1]
        if not chunk or n <= chunk:
            return self.forward(ids, mask)
        starts = list(range(0, n, chunk))
        if n - starts[-1] == 1:  # a last chunk of one token would be taken for a decoding step
            starts.pop()
        ends = [*starts[1:], n]
        probing = question is not None and self.cache.query_window > 0
        for start, end in zip(starts, ends, strict=True):
            if probing and question is not None and end <= n - question[0].shape[1]:
                with self.cache.held():
                    logits = self.forward(ids[:, start:end], mask[:, start:end])
                    self.probe(*question)
                continue
            logits = self.forward(ids[:, start:end], mask[:, start:end])
        return logits

    def probe(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Run `ids` (b, m) after what the cache holds on a probe sharing its tensors, and lend the
        cache the queries the probe observed (`KVCache.probe_fork`); billed to compression."""
        started = self.cache.compress_clock.start(self.model.device)
        probe = Runner(self.model, self.cache.probe_fork(), hooks=[])
        probe.mask = self.mask
        probe.forward(ids, mask)
        self.cache.borrow_queries(probe.cache)
        self.cache.compress_clock.stop(started)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, chunk_mask: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """Run one chunk (b, q); the last position's logits (b, vocab), or those of the chunk's
        positions `at` (k,) (b, k, vocab): the vocabulary projection is paid only where read."""
        device = self.model.device
        # read before the mask moves: an unpadded batch passes no mask, so no step reads one back from the device
        padded = self.cache.seq.padding is not None or not bool(chunk_mask.all())
        ids, chunk_mask = ids.to(device), chunk_mask.to(device)
        self.mask = chunk_mask if self.mask is None else torch.cat([self.mask, chunk_mask], dim=1)
        start = self.mask.shape[1] - ids.shape[1]
        slots = torch.arange(start, self.mask.shape[1], device=device)
        self.cache.first_slot(slots, start)  # no layer reads the slots back from the device either
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, start:] if padded else slots.expand(len(ids), -1)
        for stage in self.hooks:
            stage.tokens_in(self, ids, chunk_mask)
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask if padded else None,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if at is None else torch.cat([at, torch.tensor([ids.shape[1] - 1])]).to(device),
            cache_position=slots,
        )
        self.last_logits = out.logits[:, -1].float()
        if self.cache.needs & PROMPT_PASSES:  # only a pass over the prompt re-reads the tokens: not per step else
            self.rows = self.rows or [[] for _ in range(len(ids))]
            for row, chunk, real in zip(self.rows, ids.tolist(), chunk_mask.bool().tolist(), strict=True):
                row.extend(token for token, keep in zip(chunk, real, strict=True) if keep)
        for stage in self.hooks:
            if ids.shape[1] > 1:
                stage.prompt_done(self)
            stage.step_done(self.cache, self.last_logits)
        return self.last_logits if at is None else out.logits[:, :-1].float()  # the last is there for last_logits


class SlabRunner:
    """Decodes one token per sequence per step on a `SlabCache` filled from a runner's prefilled
    cache, the model's forward compiled when asked: the slab's shapes never change, so
    `torch.compile(fullgraph=True)` traces one step and replays it (a new trace only if a slab
    grows, `SlabCache.grown`). Between steps the cache's policy evicts as it would on the KVCache."""

    def __init__(self, runner: Runner, new_tokens: int, compile: bool = False, backend: str = "inductor") -> None:
        assert runner.mask is not None, "prefill the runner first"
        self.model, self.runner = runner.model, runner
        with torch.inference_mode():  # the step's tensors are inference tensors: a guard sees them alike
            self.slab = SlabCache(runner.cache, new_tokens)
            self.position = runner.mask.sum(-1, keepdim=True)  # (b, 1) each sequence's next position
        self.step = torch.compile(self._step, fullgraph=True, dynamic=False, backend=backend) if compile else self._step

    def _step(self, ids: torch.Tensor, position: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids, position_ids=position, past_key_values=self.slab, use_cache=True, cache_position=slot
        )
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run one token per sequence, ids (b, 1); its logits (b, vocab)."""
        device = self.model.device
        slot = torch.tensor([self.slab.seen], device=device)
        logits = self.step(ids.to(device), self.position, slot)
        self.position = self.position + 1
        self.slab.advance(1)
        runner = self.runner  # the runner's sequence goes on with the slab's (its cache views the slab)
        assert runner.mask is not None
        runner.mask = torch.cat([runner.mask, runner.mask.new_ones(runner.mask.shape[0], 1)], dim=1)
        runner.last_logits = logits
        return logits


def warm_up(model: Any) -> None:
    """One short forward so kernel set-up is not billed to the first timed run."""
    if getattr(model, "_kvstack_warm", False):
        return
    with torch.inference_mode():
        ids = torch.zeros((1, 16), dtype=torch.long, device=model.device)
        model(input_ids=ids, past_key_values=KVCache(model), use_cache=True)
    model._kvstack_warm = True


DECODE_ON = ("cache", "slab", "compiled")


def check_decode_on(decode_on: str, stack: Stack) -> None:
    """One-line error for an unknown decoding storage, or a slab the stack cannot decode on."""
    if decode_on not in DECODE_ON:
        raise UserError(f"decode on {decode_on!r}: use one of {', '.join(DECODE_ON)}")
    if decode_on != "cache":
        check_slab(stack)


def check_prompts(model: Any, prompts: list[Prompt], max_new_tokens: int, stack: Stack, budget: Budget) -> None:
    """One-line errors for prompts the model or the budget cannot take."""
    check_lengths(model, prompts, max_new_tokens)
    check_config(prompts, stack, budget)


def check_lengths(model: Any, prompts: list[Prompt], max_new_tokens: int) -> None:
    """One-line errors for prompts the model cannot take (empty, or longer than its positions)."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for p in prompts:
        if not p.context and not p.question:
            raise UserError("the prompt is empty: give a non-empty context or question")
        total = len(p.context) + len(p.question) + max_new_tokens
        if limit and total > limit:
            raise UserError(
                f"context of {len(p.context)} tokens + question {len(p.question)} + "
                f"{max_new_tokens} new tokens exceeds the model's maximum of {limit} tokens; "
                "shorten the context"
            )


def check_config(prompts: list[Prompt], stack: Stack, budget: Budget) -> None:
    """One-line error when the budget keeps fewer tokens of the shortest context than the stack needs."""
    stack.check_budget(budget)
    if budget.fraction is not None and stack.evictor is not None and not budget.is_full:
        shortest = min(len(p.context) for p in prompts)
        if shortest and budget.fraction * shortest < stack.min_tokens and shortest > stack.min_tokens:
            least = stack.min_tokens / shortest
            raise UserError(
                f"budget {budget} keeps about {int(budget.fraction * shortest)} of {shortest} tokens "
                f"but {stack.evictor.name} needs at least {stack.min_tokens}: use --budget >= "
                f"{least:.3f} or {stack.min_tokens}t"
            )


def generate_ids(
    model: Any,
    prompts: list[Prompt],
    stack: Stack | str = "full",
    budget: Budget | str | float = 1.0,
    query_agnostic: bool = False,
    max_new_tokens: int = 32,
    eos_ids: set[int] | None = None,
    pad_id: int = 0,
    prefill_chunk: int | None = None,
    decode_on: str = "cache",
) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy generation for a batch of prompts under a compression stack; ids and measurements.

    prefill_chunk: prefill the context in chunks of this many tokens, compressing between them
    (peak KV bytes about the budget plus one chunk: `peak_kv_bytes`); None prefills at once.
    decode_on: "cache" (the KVCache), "slab" or "compiled" (fixed-shape storage, `SlabRunner`;
    compiled, the first step, which compiles, is timed apart as `compile_s`)."""
    stack = stack if isinstance(stack, Stack) else Stack.parse(stack)
    budget = Budget.parse(budget)
    check_decode_on(decode_on, stack)
    check_prompts(model, prompts, max_new_tokens, stack, budget)
    if prefill_chunk is not None and prefill_chunk < 2:
        raise UserError(f"prefill chunk of {prefill_chunk} tokens: give at least 2 (e.g. 512)")
    runner = Runner(model, KVCache(model, stack, budget))
    start = now(model.device)
    if query_agnostic:
        runner.prefill(*left_pad([p.context for p in prompts], pad_id), prefill_chunk)
        logits = ask(runner, prompts, pad_id)
    else:
        # the question scores each chunk (a probe) only if every row asks one: a row without would be scored by padding
        question = left_pad([p.question for p in prompts], pad_id) if all(p.question for p in prompts) else None
        logits = runner.prefill(*left_pad([p.context + p.question for p in prompts], pad_id), prefill_chunk, question)
    prefill_s = now(model.device) - start - runner.cache.compress_clock.seconds
    return _finish(runner, logits, prefill_s, max_new_tokens, eos_ids or set(), query_agnostic, decode_on)


def compress_ids(
    model: Any,
    ids: list[int],
    stack: Stack | str = "full",
    budget: Budget | str | float = 1.0,
    prefill_chunk: int | None = None,
) -> KVCache:
    """A cache holding one sequence `ids`, compressed before any question (query-agnostic), with the
    model's last logits kept (`last_logits`): ready to save, join or answer from (`generate_from`)."""
    stack = stack if isinstance(stack, Stack) else Stack.parse(stack)
    budget = Budget.parse(budget)
    check_lengths(model, [Prompt(ids, [])], 1)
    check_config([Prompt(ids, [])], stack, budget)
    runner = Runner(model, KVCache(model, stack, budget))
    runner.prefill(*left_pad([ids], 0), prefill_chunk)
    runner.cache.last_logits = runner.last_logits
    return runner.cache


def resume(model: Any, cache: KVCache, last_logits: torch.Tensor | None = None) -> Runner:
    """A runner that goes on from `cache` as it stands (one loaded from a file): the sequence mask
    is rebuilt from the cache's padding (b, slots), so new tokens take the positions after it."""
    runner = Runner(model, cache)
    first = cache.layers[0]
    padding = cache.seq.padding
    runner.mask = (padding.long() if padding is not None else torch.ones(first.batch, first.seen, dtype=torch.long)).to(
        model.device
    )
    runner.last_logits = last_logits if last_logits is not None else cache.last_logits
    return runner


def generate_from(
    model: Any,
    cache: KVCache,
    questions: list[list[int]],
    last_logits: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    eos_ids: set[int] | None = None,
    pad_id: int = 0,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy generation after a compressed context already in `cache` (query-agnostic: each
    question, one per row, is appended uncompressed, as `generate_ids(..., query_agnostic=True)`
    does after compressing). `prefill_s` is the question's forward pass; the cache is changed."""
    if len(questions) != cache.layers[0].batch:
        raise UserError(
            f"{len(questions)} questions for a cache of {cache.layers[0].batch} sequences: give one per row"
        )
    runner = resume(model, cache, last_logits)
    if runner.last_logits is None and not all(questions):
        raise UserError("this cache was saved without the context's last logits: ask a question")
    start = now(model.device)
    compressing = cache.compress_clock.seconds
    logits = ask(runner, [Prompt([], q) for q in questions], pad_id)
    prefill_s = now(model.device) - start - (cache.compress_clock.seconds - compressing)
    return _finish(runner, logits, prefill_s, max_new_tokens, eos_ids or set(), query_agnostic=True)


def generate_forks(
    model: Any,
    prompts: list[Prompt],
    configs: list[tuple[Stack | str, Budget | str | float]],
    max_new_tokens: int = 32,
    eos_ids: set[int] | None = None,
    pad_id: int = 0,
) -> Iterator[tuple[list[list[int]], dict[str, Any]]]:
    """Query-agnostic generation for many (stack, budget) pairs from one prefill of the contexts.

    The contexts are prefilled once into a full cache that records what every stack needs;
    each pair then forks that cache, compresses it, appends the questions and decodes. The
    results equal `generate_ids(..., query_agnostic=True)` per pair (tested), at a fraction of
    the cost: this is what a benchmark sweep runs. A pair the cache refuses (a quantizer's
    residual window above the budget, say) yields ([], {"refused": the one-line reason}).
    """
    stacks = _parse_configs(configs)
    check_lengths(model, prompts, max_new_tokens)
    source = _observing_runner(model, stacks)
    start = now(model.device)
    source.forward(*left_pad([p.context for p in prompts], pad_id))
    prefill_s = now(model.device) - start - source.cache.compress_clock.seconds
    for stack, budget in stacks:
        try:
            check_config(prompts, stack, budget)
            runner = source.fork(stack, budget)
            if "reconstruction" in stack.needs:  # the shared re-reading pass is this method's work
                runner.cache.compress_clock.add(source.cache.reread_s)
            logits = ask(runner, prompts, pad_id)
            done = _finish(runner, logits, prefill_s, max_new_tokens, eos_ids or set(), query_agnostic=True)
        except UserError as err:
            yield [], {"refused": str(err)}
            continue
        yield done


def fidelity_forks(
    model: Any, context: list[int], continuation: list[int], configs: list[tuple[Stack | str, Budget | str | float]]
) -> Iterator[dict[str, Any]]:
    """Language-model fidelity per (stack, budget): compress `context`, teacher-force `continuation`.

    Yields, per config: perplexity of the continuation, mean KL(full || compressed) of the
    next-token distributions, top-1 agreement with the full cache, and the measured bytes
    (or {"refused": reason} for a pair the cache refuses).
    """
    stacks = _parse_configs(configs)
    source = _observing_runner(model, stacks)
    source.forward(torch.tensor([context]), torch.ones(1, len(context), dtype=torch.long))
    follow = torch.tensor([continuation])
    ones = torch.ones_like(follow)
    scored = torch.arange(len(continuation) - 1)  # each position predicts the next token
    reference = source.fork(Stack.parse("full"), Budget.parse(1.0)).forward(follow, ones, scored)[0]
    ref_logp = torch.log_softmax(reference, -1)
    targets = follow[0, 1:].to(reference.device)
    for stack, budget in stacks:
        try:
            runner = source.fork(stack, budget)
            if "reconstruction" in stack.needs:
                runner.cache.compress_clock.add(source.cache.reread_s)
            kv_bytes, kv_full = runner.cache.nbytes(), runner.cache.full_nbytes()
            logp = torch.log_softmax(runner.forward(follow, ones, scored)[0], -1)
        except UserError as err:
            yield {"refused": str(err)}
            continue
        kl, agree = divergence(ref_logp, logp)
        yield {
            "ppl": float(torch.exp(-logp.gather(-1, targets[:, None]).mean())),
            "kl": float(kl.mean()),
            "top1": float(agree.mean()),
            "kv_bytes": kv_bytes,
            "kv_bytes_full": kv_full,
            "kv_ratio": kv_bytes / kv_full if kv_full else 1.0,
            "compress_s": runner.cache.compress_clock.seconds,
        }


def divergence(reference: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(reference || logp), top-1 agreement as 0/1), each (..., ) per position, from next-token
    log-probabilities (..., vocab) of the full cache and of a compressed one."""
    kl = (reference.exp() * (reference - logp)).sum(-1)
    return kl, (logp.argmax(-1) == reference.argmax(-1)).double()


def _parse_configs(configs: list[tuple[Stack | str, Budget | str | float]]) -> list[tuple[Stack, Budget]]:
    return [(s if isinstance(s, Stack) else Stack.parse(s), Budget.parse(b)) for s, b in configs]


def _observing_runner(model: Any, stacks: list[tuple[Stack, Budget]]) -> Runner:
    """A runner over a full cache that records what every stack needs, so each can be forked from it."""
    needs = frozenset().union(*(s.needs for s, _ in stacks))
    window = max((s.query_window for s, _ in stacks), default=0)
    hooks = [part for s, _ in stacks for part in s.parts]  # e.g. KVzip's re-reading, once for all its forks
    return Runner(model, KVCache(model, "full", 1.0, observe=needs, query_window=window), hooks)


def ask(runner: Runner, prompts: list[Prompt], pad_id: int) -> torch.Tensor | None:
    """Append the questions uncompressed (exempt) after a compressed context; last logits."""
    before = runner.last_logits
    if not any(p.question for p in prompts):
        return before
    with runner.cache.exempt():
        logits = runner.forward(*left_pad([p.question for p in prompts], pad_id))
    empty = torch.tensor([not p.question for p in prompts], device=logits.device)
    if bool(empty.any()) and before is not None:  # a row without a question continues its context
        logits = torch.where(empty[:, None], before, logits)
    return logits


def _finish(
    runner: Runner,
    logits: torch.Tensor | None,
    prefill_s: float,
    max_new_tokens: int,
    eos: set[int],
    query_agnostic: bool,
    decode_on: str = "cache",
) -> tuple[list[list[int]], dict[str, Any]]:
    """Measure the compressed prompt, decode greedily (on the cache, or on a slab filled from it),
    and report ids and measurements."""
    cache = runner.cache
    assert logits is not None
    kv_bytes, kv_full = cache.nbytes(), cache.full_nbytes()
    slab = SlabRunner(runner, max_new_tokens, compile=decode_on == "compiled") if decode_on != "cache" else None
    b = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    start = now(logits.device)
    steps, fetched, fetch_s = 0, cache.fetched_nbytes, cache.fetch_clock.seconds
    compile_s: float | None = None
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1).cpu()
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
                done[i] = int(nxt[i]) in eos
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if slab is not None:
            logits = slab.forward(nxt.unsqueeze(1))
        else:
            logits = runner.forward(nxt.unsqueeze(1), torch.ones((b, 1), dtype=torch.long))
        if decode_on == "compiled" and compile_s is None:  # the first step traced and compiled: not decoding
            compile_s = now(logits.device) - start
            start = now(logits.device)
            continue
        steps += 1
    decode_s = now(logits.device) - start
    if slab is not None:  # the cache's layers view what the slab holds, for `stats`
        slab.slab.sync()
    measures = {
        "kv_bytes": kv_bytes,
        "kv_bytes_full": kv_full,
        "kv_ratio": kv_bytes / kv_full if kv_full else 1.0,
        "kv_bytes_end": slab.slab.nbytes() if slab is not None else cache.nbytes(),
        "peak_kv_bytes": max(cache.peak_nbytes, kv_bytes),
        "kv_bytes_full_end": cache.full_nbytes(),
        "prefill_s": prefill_s,
        "compress_s": cache.compress_clock.seconds,
        "decode_s": decode_s,
        "decode_tokens_per_s": steps * b / decode_s if decode_s > 0 and steps else 0.0,
        "offloaded_bytes": cache.offloaded_nbytes(),
        "fetched_bytes_per_step": (cache.fetched_nbytes - fetched) / steps if steps else 0.0,
        "fetch_s_per_step": (cache.fetch_clock.seconds - fetch_s) / steps if steps else 0.0,
        "stats": cache.stats(),
        "method": str(cache.stack),
        "budget": str(cache.budget),
        "mode": "agnostic" if query_agnostic else "aware",
        "decode_on": decode_on,
        "compile_s": compile_s or 0.0,
    }
    for eos_id in eos:  # drop the end-of-sequence token itself
        out = [o[:-1] if o and o[-1] == eos_id else o for o in out]
    return out, measures
