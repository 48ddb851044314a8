"""`kvzip`: KVzip (Kim et al., 2025): keep what the model needs to reconstruct the context."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.registry import register
from kvstack.timing import now

REPEAT = "\n\nRepeat the previous context exactly."
REPEAT_PART = "\n\nRepeat the part of the previous context exactly, starting with "


@register
@dataclass
class KVzip(Method):
    """Query-agnostic: after the prompt, the model is asked to repeat it (teacher-forced, chunk by
    chunk) and each cached pair is scored by the most attention any reconstruction query of its
    head's group gives it (max over queries and group); the pairs reconstruction needs survive,
    whatever question comes later. The first `sinks` tokens are kept (kvpress's n_sink 4).

    Costs one extra forward pass over the prompt (`reread`, run by the `prompt_done` hook).
    Deviations from the reference (snu-mllab/KVzip attention/score.py): each chunk attends to the
    whole prompt rather than only its slice, and the per-head top-k is uniform unless an
    allocator is stacked (the paper's default prunes with one threshold over all heads:
    `adakv(kvzip)` shares a layer's budget the same way within the layer). The reference leaves
    sliding-window layers (Gemma 3) whole; here they are compressed like the others, and their
    tokens are scored by the queries that repeat them, past the window that would hide those
    queries from them (through the window only the first few hundred repeated tokens, the start
    of the context, would score the end it holds). Decoding tokens have
    no reconstruction score: past `decode_window` they are the first to go, as when kvpress
    compresses once and stops.

    Shapes: the statistic "reconstruction" (b, h, t) -> scores (b, h, t).
    """

    name = "kvzip"
    family = "evict"
    paper = "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction (arXiv 2505.23416)"
    needs = frozenset({"reconstruction"})
    provides = frozenset({"reconstruction"})
    sinks: int = 4
    chunk_size: int = 2048
    every: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"kvzip: sinks must be >= 0, got {self.sinks}")
        if self.chunk_size < 16:
            raise ValueError(f"kvzip: chunk_size must be >= 16 tokens, got {self.chunk_size}")

    def score(self, obs: Observation) -> torch.Tensor:
        scores = obs.stat("reconstruction")
        sink = obs.valid & (obs.positions < self.sinks)
        return torch.where(sink, torch.full_like(scores, float("inf")), scores)

    def prompt_done(self, runner: Any) -> None:
        if runner.cache.policy.waiting:
            reread(runner, self.chunk_size)


def reread(runner: Any, chunk_size: int) -> float:
    """The re-reading pass after a prompt: teacher-force "repeat the context" on full forks of the
    prompt's cache (`runner`: the loop's `kvstack.generate.Runner`), record the most attention each
    prompt token gets from the reconstruction, then compress. Seconds spent, billed to the cache's
    compression clock and kept as `cache.reread_s` (forks of a shared prefill add it)."""
    cache = runner.cache
    device = runner.model.device
    started = now(device)
    repeat, part = getattr(runner.model, "_kvstack_repeat_ids", ([], []))
    chunks = [reconstruction_chunks(row, chunk_size, repeat, part) for row in runner.rows]
    held = [layer.head_len(0) for layer in cache.layers]  # a full cache: every head holds the prompt
    scores = [
        [torch.zeros(layer.batch, held[i], device=device) for _ in range(layer.n_kv_heads)]
        for i, layer in enumerate(cache.layers)
    ]
    for c in range(max(len(ch) for ch in chunks)):
        fork = runner.fork("full", 1.0)
        fork.cache.extra_needs = frozenset({"max_attention"})
        fork.cache.windowless_statistics = True  # a sliding layer's tokens are scored by the queries repeating them
        fork.forward_rows([ch[c] if c < len(ch) else [] for ch in chunks])
        for i, layer in enumerate(fork.cache.layers):
            for h, most in enumerate(layer.stats["max_attention"]):
                scores[i][h] = torch.maximum(scores[i][h], most[:, : held[i]])
    for layer, per_head in zip(cache.layers, scores, strict=True):
        layer.stats["reconstruction"] = per_head
    seconds = now(device) - started
    cache.compress_clock.add(seconds)
    cache.reread_s += seconds
    cache.policy.compress_all()
    return seconds


def reconstruction_chunks(
    context: list[int], chunk_size: int, repeat: list[int], repeat_part: list[int], overlap: int = 8
) -> list[list[int]]:
    """The teacher-forced inputs that ask the model to repeat `context`, one per chunk of `chunk_size`
    tokens: the first after `repeat`, the next ones after `repeat_part` + the last `overlap` tokens
    of the chunk before (KVzip's prompts, model/wrapper.py)."""
    chunks = [context[i : i + chunk_size] for i in range(0, len(context), chunk_size)]
    out = []
    for i, chunk in enumerate(chunks):
        lead = repeat if i == 0 else repeat_part + chunks[i - 1][-overlap:]
        out.append(lead + chunk)
    return out
