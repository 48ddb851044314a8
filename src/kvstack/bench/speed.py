"""`kvstack speed`: prefill seconds, decode tokens/s and KV bytes of transformers' own caches and
of kvstack stacks, on one model in one process after a warm-up, so that rows compare as ratios.

Rows (`Engine`): transformers' sdpa attention with its DynamicCache (the baseline users know) and
StaticCache, kvstack's full cache, and any stacks at their budgets. Each measured point prefills
a prompt of `length` token ids (seeded random ids: speed does not depend on what they say),
then decodes `new_tokens` greedily. Repeats are interleaved (every row once, then again) and the
median is kept, so a slow spell of a shared machine hits every row alike.
"""

from __future__ import annotations

import difflib
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvstack.cache.budget import Budget
from kvstack.errors import UserError
from kvstack.timing import now

HF_DYNAMIC = "sdpa+DynamicCache"  # transformers' defaults: what a user runs without kvstack
HF_STATIC = "sdpa+StaticCache"
BASELINES = (HF_DYNAMIC, HF_STATIC)
SLAB_MODES = ("slab", "compiled")


@dataclass(frozen=True)
class Engine:
    """One row: a transformers baseline (`stack` None) or a kvstack stack at a budget."""

    label: str
    stack: str | None = None
    budget: str = "1.0"
    mode: str = "cache"  # kvstack's KVCache, or decoding on a slab (`SlabCache`), eager or compiled

    @classmethod
    def parse(cls, text: str) -> Engine:
        """`sdpa+DynamicCache`, `sdpa+StaticCache`, `full`, or `STACK@BUDGET` (`keydiff@0.125`;
        no `@` means budget 1.0), with `:slab` or `:compiled` to decode on fixed-shape storage
        (`keydiff@0.125:compiled`). The stack and budget are checked here, before any model loads."""
        from kvstack.cache.slab_cache import check_slab
        from kvstack.stack import Stack

        text = text.strip()
        if text.lower() in (b.lower() for b in BASELINES):
            return cls(next(b for b in BASELINES if b.lower() == text.lower()))
        mode = next((m for m in SLAB_MODES if text.endswith(f":{m}")), "cache")
        text = text.removesuffix(f":{mode}")
        if ":" in text.rpartition("@")[2]:  # a mode this engine does not know (no stack spec holds a colon)
            word = text.rpartition(":")[2]
            close = difflib.get_close_matches(word, SLAB_MODES, n=1)
            hint = f" (did you mean :{close[0]}?)" if close else ""
            raise UserError(f"unknown decoding mode ':{word}' in {text}: use :{' or :'.join(SLAB_MODES)}{hint}")
        spec, at, budget = text.rpartition("@") if "@" in text else (text, "", "1.0")
        stack = Stack.parse(spec)
        parsed = Budget.parse(budget)
        stack.check_budget(parsed)
        if mode != "cache":
            check_slab(stack)
        label = stack.label if parsed.is_full else f"{stack.label}@{budget.strip()}"
        return cls(label if mode == "cache" else f"{label}:{mode}", stack.label, budget.strip(), mode)


@dataclass
class SpeedRow:
    """One engine at one length: medians over the repeats, bytes read off the cache's tensors."""

    engine: str
    length: int
    new_tokens: int
    prefill_s: float
    decode_tokens_per_s: float
    kv_bytes: int  # held after the prompt (prefill and compression)
    kv_bytes_end: int  # held after decoding
    peak_kv_bytes: int  # the most the cache held at once while the prompt went in
    repeats: int
    device: str
    fetched_bytes_per_step: float = 0.0  # read back from a retriever's slow tier per decoded token
    fetch_s_per_step: float = 0.0  # ranking pages and reading them, per decoded token

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def prompt_ids(length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(1, length) token ids drawn with a fixed seed from the vocabulary, special ids (the first
    few hundred) left out."""
    rng = random.Random(seed * 1_000_003 + length)
    low = min(300, vocab // 4)
    return torch.tensor([[rng.randrange(low, vocab) for _ in range(length)]])


def _hf_run(model: Any, ids: torch.Tensor, new_tokens: int, static: bool) -> tuple[float, float, int, int]:
    """transformers' sdpa over its own cache: (prefill s, decode s, bytes after prompt, bytes at end)."""
    from transformers import DynamicCache, StaticCache

    config = model.config
    if static:
        cache = StaticCache(config=config, max_cache_len=ids.shape[1] + new_tokens)
    else:
        cache = DynamicCache(config=config)
    device = model.device
    ids = ids.to(device)
    start = now(device)
    positions = torch.arange(ids.shape[1], device=device)
    logits = model(ids, past_key_values=cache, use_cache=True, cache_position=positions, logits_to_keep=1).logits
    prefill = now(device) - start
    held = _hf_bytes(cache)
    start = now(device)
    for step in range(new_tokens - 1):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        at = torch.tensor([ids.shape[1] + step], device=device)
        logits = model(nxt, past_key_values=cache, use_cache=True, cache_position=at).logits
    decode = now(device) - start
    return prefill, decode, held, _hf_bytes(cache)


def _hf_bytes(cache: Any) -> int:
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


Run = tuple[float, float, int, int, int, float, float]


def _kvstack_run(model: Any, ids: torch.Tensor, new_tokens: int, engine: Engine, chunk: int | None) -> Run:
    """kvstack's cache through its own loop (`generate`): (prefill s incl. compression, decode s,
    bytes after prompt, bytes at end, peak bytes during the prompt, bytes and seconds of slow-tier
    reads per decoded token)."""
    if engine.mode != "cache":
        return _slab_run(model, ids, new_tokens, engine, chunk)
    runner, logits, prefill = _prefilled(model, ids, engine, chunk)
    cache, device = runner.cache, model.device
    held, peak = cache.nbytes(), cache.peak_nbytes
    one = torch.ones(1, 1, dtype=torch.long)
    fetched, fetch_s = cache.fetched_nbytes, cache.fetch_clock.seconds
    start = now(device)
    for _ in range(new_tokens - 1):
        logits = runner.forward(logits.argmax(-1, keepdim=True).cpu(), one)
    decode = now(device) - start
    steps = new_tokens - 1
    tier = ((cache.fetched_nbytes - fetched) / steps, (cache.fetch_clock.seconds - fetch_s) / steps)
    return prefill, decode, held, cache.nbytes(), max(peak, held), *tier


def _prefilled(model: Any, ids: torch.Tensor, engine: Engine, chunk: int | None) -> tuple[Any, torch.Tensor, float]:
    """A runner over a new cache for the engine's stack, after the prompt (`Runner`), its last
    logits (1, vocab) and the prefill's seconds (compression included)."""
    from kvstack.cache.cache import KVCache
    from kvstack.generate import Runner

    assert engine.stack is not None
    runner = Runner(model, KVCache(model, engine.stack, engine.budget))
    start = now(model.device)
    logits = runner.prefill(ids, torch.ones_like(ids), chunk)
    return runner, logits, now(model.device) - start


def _slab_run(model: Any, ids: torch.Tensor, new_tokens: int, engine: Engine, chunk: int | None) -> Run:
    """`_kvstack_run` decoding on a slab (`SlabRunner`), compiled when the engine says so. Bytes
    are the slab's, allocated from the first step; compiled, the first decoding step (the trace
    and its compilation) is left out of the time and the others are scaled to `new_tokens - 1`."""
    from kvstack.generate import SlabRunner

    runner, logits, prefill = _prefilled(model, ids, engine, chunk)
    device, peak = model.device, runner.cache.peak_nbytes
    slab = SlabRunner(runner, new_tokens, compile=engine.mode == "compiled")
    held = slab.slab.nbytes()
    steps = new_tokens - 1
    if engine.mode == "compiled":  # its first step traces and compiles: not decoding speed
        logits, steps = slab.forward(logits.argmax(-1, keepdim=True)), steps - 1
    start = now(device)
    for _ in range(steps):
        logits = slab.forward(logits.argmax(-1, keepdim=True))
    decode = (now(device) - start) * (new_tokens - 1) / max(steps, 1)
    return prefill, decode, held, slab.slab.nbytes(), max(peak, held), 0.0, 0.0


def measure(
    model: Any,
    engines: list[Engine],
    lengths: list[int],
    new_tokens: int = 32,
    repeats: int = 1,
    prefill_chunk: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[SpeedRow]:
    """Every engine at every length, interleaved `repeats` times after one warm-up pass of every
    engine at the shortest length; medians. kvstack rows prefill in chunks of `prefill_chunk`
    tokens when given (compressing between them). The model is switched between sdpa and kvstack attention
    and left on kvstack's."""
    if new_tokens < 2:
        raise UserError(f"--new-tokens {new_tokens}: decoding speed needs at least 2 new tokens")
    if new_tokens < 3 and any(e.mode == "compiled" for e in engines):
        raise UserError(f"--new-tokens {new_tokens}: a compiled row needs at least 3 (its first step compiles)")
    limit = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0)
    longest = max(lengths)
    if limit and longest + new_tokens > limit:
        raise UserError(
            f"length {longest} + {new_tokens} new tokens exceeds the model's maximum of {limit} tokens: "
            "give shorter --lengths"
        )
    vocab = model.config.get_text_config().vocab_size
    device = str(model.device) if model.device.type == "cpu" else torch.cuda.get_device_name(model.device)
    runs: dict[tuple[str, int], list[Run]] = {}
    plan = [(min(lengths), -1)] + [(length, r) for r in range(repeats) for length in lengths]
    try:
        for length, rep in plan:
            ids = prompt_ids(length, vocab)
            for engine in engines:
                if progress is not None:
                    what = "warm-up" if rep < 0 else f"repeat {rep + 1}/{repeats}"
                    progress(f"{engine.label} at {length} tokens ({what})")
                got = _run(model, engine, ids, new_tokens, prefill_chunk)
                if rep >= 0:
                    runs.setdefault((engine.label, length), []).append(got)
    finally:
        model.set_attn_implementation("kvstack")
    rows = []
    for length in lengths:
        for engine in engines:
            got = runs[(engine.label, length)]
            prefill = statistics.median(g[0] for g in got)
            decode = statistics.median(g[1] for g in got)
            rows.append(
                SpeedRow(
                    engine.label,
                    length,
                    new_tokens,
                    prefill,
                    (new_tokens - 1) / decode if decode > 0 else float("inf"),
                    got[-1][2],
                    got[-1][3],
                    got[-1][4],
                    repeats,
                    device,
                    statistics.median(g[5] for g in got),
                    statistics.median(g[6] for g in got),
                )
            )
    return rows


def _run(model: Any, engine: Engine, ids: torch.Tensor, new_tokens: int, chunk: int | None) -> Run:
    with torch.inference_mode():
        if engine.stack is None:
            model.set_attn_implementation("sdpa")
            prefill, decode, held, end = _hf_run(model, ids, new_tokens, static=engine.label == HF_STATIC)
            return prefill, decode, held, end, held, 0.0, 0.0
        model.set_attn_implementation("kvstack")
        return _kvstack_run(model, ids, new_tokens, engine, chunk)


def ratios(rows: list[SpeedRow], reference: str) -> dict[tuple[str, int], tuple[float, float]]:
    """(engine, length) -> (prefill speed, decode speed) relative to `reference` at that length:
    > 1 is faster (prefill as reference seconds / seconds)."""
    ref = {r.length: r for r in rows if r.engine == reference}
    out = {}
    for r in rows:
        base = ref.get(r.length)
        if base is None:
            continue
        out[(r.engine, r.length)] = (base.prefill_s / r.prefill_s, r.decode_tokens_per_s / base.decode_tokens_per_s)
    return out


def plot(rows: list[SpeedRow], path: Any) -> None:
    """Prefill seconds, decode tokens/s and KV bytes against context length, a line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    engines = list(dict.fromkeys(r.engine for r in rows))
    panels = (
        ("prefill (s, lower is better)", lambda r: r.prefill_s),
        ("decode (tokens/s, higher is better)", lambda r: r.decode_tokens_per_s),
        ("KV cache held after the prompt (MiB)", lambda r: r.kv_bytes / 2**20),
    )
    for ax, (title, value) in zip(axes, panels, strict=True):
        for engine in engines:
            mine = sorted((r for r in rows if r.engine == engine), key=lambda r: r.length)
            style = "--" if engine in BASELINES else "-"
            ax.plot([r.length for r in mine], [value(r) for r in mine], style, marker="o", label=engine)
        ax.set_title(title)
        ax.set_xlabel("context length (tokens)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"kvstack speed on {rows[0].device}, {rows[0].new_tokens} new tokens, median of {rows[0].repeats}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
