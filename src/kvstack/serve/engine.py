"""The engine: one thread owns the model and runs every request, iteration by iteration.

Each iteration admits waiting requests first, in arrival order, while their reserved KV bytes fit
in `--kv-memory` (`admission`), prefilling and compressing each; then it steps every running
request by one token. Requests join and leave between iterations (continuous batching at the
iteration level, as Orca schedules; each request's step is its own forward pass over its own
compressed cache, since two requests' caches may hold different methods and budgets).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.generate import Prompt, Runner, ask, check_config, check_lengths, left_pad, resume, warm_up
from kvstack.models.loading import LoadedModel
from kvstack.models.prompts import eos_ids
from kvstack.reuse.store import PrefixStore
from kvstack.serve.admission import Ledger, final_bytes, first_bytes
from kvstack.stack import Stack


class QueueFull(Exception):
    """The waiting queue is full: the client should retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is full: retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn from the logits: greedy at temperature 0 (the default: answers equal
    `kvstack generate`'s), else softmax at `temperature` within the top-`top_p` mass, seeded."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token id from next-token logits (vocab,)."""
        if self.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, -1)
        if self.top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            outside = ordered.cumsum(-1) - ordered > self.top_p  # keep the smallest head reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order, ordered.masked_fill(outside, 0.0))
        return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Event:
    """What the engine tells a request's consumer: new `text`, then once `finish` ("stop",
    "length", "cancelled", "refused": the request's own error, or "error": the server's) with
    `usage` and the cache's measurements in `kv`."""

    text: str = ""
    finish: str | None = None
    usage: dict[str, int] | None = None
    kv: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class Job:
    """One request: `context` is compressed (the prompt, or a document the prefix store keeps under
    `document`); `question` follows it uncompressed (after a document only)."""

    context: list[int]
    question: list[int]
    stack: Stack
    budget: Budget
    max_tokens: int
    emit: Callable[[Event], None]
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    document: str | None = None
    key: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    # running state
    runner: Runner | None = None
    logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the answer already emitted
    kv: dict[str, Any] = field(default_factory=dict)
    generator: torch.Generator | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.context) + len(self.question)


@dataclass
class Counters:
    """What `/metrics` reports beside the ledger."""

    finished: dict[str, int] = field(default_factory=dict)  # by finish reason, refusals too
    prompt_tokens: int = 0
    generated_tokens: int = 0
    store_hits: int = 0
    store_misses: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) steps
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=64))  # seconds per finished request

    def count(self, outcome: str) -> None:
        self.finished[outcome] = self.finished.get(outcome, 0) + 1


class Engine:
    """Serves `lm` with `stack` at `budget` by default, holding at most `kv_memory` bytes of KV cache
    over all running requests, with at most `max_waiting` requests queued behind them."""

    def __init__(
        self,
        lm: LoadedModel,
        stack: Stack,
        budget: Budget,
        kv_memory: int,
        store: PrefixStore | None = None,
        max_waiting: int = 64,
        prefill_chunk: int | None = None,
    ) -> None:
        self.lm, self.stack, self.budget, self.store = lm, stack, budget, store
        self.max_waiting, self.prefill_chunk = max_waiting, prefill_chunk
        self.ledger = Ledger(kv_memory)
        self.counters = Counters()
        self.eos = eos_ids(lm)
        self.pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
        self.token_bytes = _token_bytes(lm.model)
        self._keys = itertools.count(1)
        self._inbox: queue.Queue[Job] = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstack-engine", daemon=True)

    # ---- the HTTP side (any thread) ----

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    def check(self, job: Job) -> None:
        """One-line errors for a request that can never run: too long for the model, a budget the
        stack refuses, or more KV bytes than the whole `kv_memory`."""
        check_lengths(self.lm.model, [Prompt(job.context, job.question)], job.max_tokens)
        check_config([Prompt(job.context, job.question)], job.stack, job.budget)
        need = self._first_bytes(job)
        if need > self.ledger.capacity:
            raise UserError(
                f"this request needs {need / 2**20:.1f} MiB of KV cache ({job.prompt_tokens} prompt tokens "
                f"+ {job.max_tokens} new at budget {job.budget}), more than the server's --kv-memory of "
                f"{self.ledger.capacity / 2**20:.1f} MiB: shorten the prompt, lower max_tokens or kv_budget"
            )

    def submit(self, job: Job) -> None:
        """Queue `job` (after `check`); `QueueFull` when it cannot start now and `max_waiting`
        requests already wait."""
        waiting = self._inbox.qsize() + len(self._waiting)
        starts_now = waiting == 0 and self.ledger.fits(self._first_bytes(job))
        if waiting >= self.max_waiting and not starts_now:
            self.counters.count("refused")
            raise QueueFull(self.retry_after())
        job.key = next(self._keys)
        self._inbox.put(job)
        self._wake.set()

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one request's time, from the recent ones."""
        done = list(self.counters.durations)
        return max(1, min(60, round(sum(done) / len(done)))) if done else 1

    def snapshot(self) -> dict[str, Any]:
        """The numbers `/metrics` shows, read now."""
        held, reserved, running = self.ledger.totals()
        now = time.perf_counter()
        recent = [n for t, n in list(self.counters.recent) if now - t <= 10.0]
        return {
            "kv_memory_bytes": self.ledger.capacity,
            "kv_bytes_held": held,
            "kv_bytes_reserved": reserved,
            "kv_bytes_held_peak": self.ledger.peak_held,
            "requests_running": running,
            "requests_running_peak": self.ledger.peak_running,
            "requests_waiting": self._inbox.qsize() + len(self._waiting),
            "tokens_per_second": sum(recent) / 10.0,
            "finished": dict(self.counters.finished),
            "prompt_tokens": self.counters.prompt_tokens,
            "generated_tokens": self.counters.generated_tokens,
            "store_hits": self.counters.store_hits,
            "store_misses": self.counters.store_misses,
        }

    # ---- the engine thread ----

    def _loop(self) -> None:
        warm_up(self.lm.model)
        while not self._stopping.is_set():
            while not self._inbox.empty():
                self._waiting.append(self._inbox.get_nowait())
            self._admit()
            for job in list(self._running):
                self._guarded(job, self._step)
            if not self._running and not self._waiting:
                self._wake.wait(0.5)
                self._wake.clear()
        for job in self._running + list(self._waiting):
            self._finish(job, "cancelled")

    def _admit(self) -> None:
        """Start waiting requests in arrival order while their reservations fit (prefills first:
        a request admitted now holds its bytes at once; the running ones step after)."""
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                self._finish(job, "cancelled", running=False)
                continue
            need = self._first_bytes(job)
            if not self.ledger.fits(need):
                return
            self._waiting.popleft()
            self.ledger.reserve(job.key, need)
            self._running.append(job)
            self._guarded(job, self._prefill)

    def _guarded(self, job: Job, work: Callable[[Job], None]) -> None:
        """Run one job's work; a failure ends that request with an error, never the engine."""
        try:
            work(job)
        except UserError as e:  # the request's own (a budget its method refuses on this prompt): a 400
            job.kv["error"] = str(e)
            self._finish(job, "refused")
        except Exception as e:  # noqa: BLE001  (reported to the client, the server goes on)
            job.kv["error"] = f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._finish(job, "error")

    def _prefill(self, job: Job) -> None:
        started = time.perf_counter()
        if job.document is not None and self.store is not None:
            cache, hit = self.store.cache_for(self.lm, job.document, job.stack, job.budget, self.prefill_chunk)
            if hit:
                self.counters.store_hits += 1
            else:
                self.counters.store_misses += 1
            job.kv["prefix_store"] = "hit" if hit else "miss"
            runner = resume(self.lm.model, cache)
            logits = ask(runner, [Prompt([], job.question)], self.pad)
        else:
            runner = Runner(self.lm.model, KVCache(self.lm.model, job.stack, job.budget))
            logits = runner.prefill(*left_pad([job.context + job.question], self.pad), self.prefill_chunk)
        assert logits is not None
        job.runner, job.logits = runner, logits[0]
        held = runner.cache.nbytes()
        self.ledger.measure(
            job.key, held, final_bytes(job.budget, held, job.prompt_tokens, job.max_tokens, self.token_bytes)
        )
        full = runner.cache.full_nbytes()
        job.kv.update(
            kv_bytes=held,
            kv_bytes_full=full,
            kv_ratio=held / full if full else 1.0,
            method=str(job.stack),
            budget=str(job.budget),
            time_to_first_token_s=time.perf_counter() - job.arrived,
            queued_s=started - job.arrived,
        )
        self.counters.prompt_tokens += job.prompt_tokens
        if job.sampling.temperature > 0:
            job.generator = torch.Generator().manual_seed(
                job.sampling.seed if job.sampling.seed is not None else job.key
            )
        self._take(job)

    def _step(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._finish(job, "cancelled")
            return
        assert job.runner is not None
        job.logits = job.runner.forward(torch.tensor([[job.tokens[-1]]]), torch.ones((1, 1), dtype=torch.long))[0]
        self.ledger.measure(job.key, job.runner.cache.nbytes())
        self.counters.recent.append((time.perf_counter(), 1))
        self._take(job)

    def _take(self, job: Job) -> None:
        """Draw the next token from the job's logits, emit the text it completes, finish if done."""
        assert job.logits is not None
        token = job.sampling.choose(job.logits, job.generator)
        self.counters.generated_tokens += 1
        if token in self.eos:
            self._flush(job, final=True)
            self._finish(job, "stop")
            return
        job.tokens.append(token)
        text = self.lm.tokenizer.decode(job.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(0, job.sent - len(s))) for s in job.stop) if i >= 0), default=-1)
        if cut >= 0:
            job.emit(Event(text=text[job.sent : cut]))
            job.sent = cut
            self._finish(job, "stop")
        elif len(job.tokens) >= job.max_tokens:
            self._flush(job, final=True, text=text)
            self._finish(job, "length")
        else:
            self._flush(job, final=False, text=text)

    def _flush(self, job: Job, final: bool, text: str | None = None) -> None:
        """Emit the answer's text not yet sent, holding back what could still become a stop string
        or an incomplete character."""
        text = text if text is not None else self.lm.tokenizer.decode(job.tokens, skip_special_tokens=True)
        end = len(text)
        if not final:
            end -= max((len(s) - 1 for s in job.stop), default=0)
            while end > job.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end > job.sent:
            job.emit(Event(text=text[job.sent : end]))
            job.sent = end

    def _finish(self, job: Job, reason: str, running: bool = True) -> None:
        if running and job in self._running:
            self._running.remove(job)
        self.ledger.release(job.key)
        if job.runner is not None:
            job.kv["kv_bytes_end"] = job.runner.cache.nbytes()
        job.runner = None  # frees the cache now, whatever the consumer holds
        self.counters.count(reason)
        self.counters.durations.append(time.perf_counter() - job.arrived)
        usage = {
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": len(job.tokens),
            "total_tokens": job.prompt_tokens + len(job.tokens),
        }
        job.emit(Event(finish=reason, usage=usage, kv=dict(job.kv), error=job.kv.get("error")))

    def _first_bytes(self, job: Job) -> int:
        stored = False
        if job.document is not None and self.store is not None:
            stored = self.store.path(self.lm.model, job.stack, job.budget, job.context).exists()
        return first_bytes(job.budget, job.prompt_tokens, job.max_tokens, self.token_bytes, stored)


def _token_bytes(model: Any) -> int:
    """Bytes one token takes in a full cache of this model (all layers, keys and values), read off
    a real cache after an 8-token prefill."""
    cache = KVCache(model)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 8), dtype=torch.long, device=model.device), past_key_values=cache)
    return -(-cache.full_nbytes() // 8)
