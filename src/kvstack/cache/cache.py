"""`KVCache`: the transformers `Cache` that kvstack owns, executing a method stack's decisions.

Use it as `past_key_values` with `model.generate` or plain forward calls on a model loaded
with `attn_implementation="kvstack"`. After each layer's attention it trims sliding windows
and, when a head holds more than its budget allows, asks the stack which tokens to keep and
gathers them into smaller tensors: memory is freed for real and `nbytes()` reads it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvstack.cache import forks, statistics
from kvstack.cache.attention import ATTENTION, LayerView, register
from kvstack.cache.budget import Budget
from kvstack.cache.factory import register_cache
from kvstack.cache.hidden import install
from kvstack.cache.layer import CompressedLayer, storage_bytes
from kvstack.cache.saved import save
from kvstack.cache.sequence import SequenceState
from kvstack.cache.tier import Fetched
from kvstack.models.config import head_dim as model_head_dim
from kvstack.models.config import text_config
from kvstack.models.rope import layer_frequencies
from kvstack.policy.policy import Policy
from kvstack.stack import Stack
from kvstack.timing import Stopwatch

register()
OPEN_END = 2**62


@register_cache
class KVCache(Cache):
    """A compressed KV cache for one model: a method stack under one budget (see module docstring)."""

    def __init__(
        self,
        model_or_config: Any,
        stack: Stack | str = "full",
        budget: Budget | str | float = 1.0,
        observe: frozenset[str] = frozenset(),
        query_window: int = 0,
    ) -> None:
        config = text_config(getattr(model_or_config, "config", model_or_config))
        if hasattr(model_or_config, "config") and getattr(config, "_attn_implementation", ATTENTION) != ATTENTION:
            raise ValueError(
                f"the model uses attn_implementation={config._attn_implementation!r}; a KVCache needs "
                f"model.set_attn_implementation({ATTENTION!r}) (kvstack.load does it)"
            )
        n_layers = config.num_hidden_layers
        n_heads = config.num_attention_heads
        n_kv = getattr(config, "num_key_value_heads", None) or n_heads
        head_dim = model_head_dim(config)
        scaling = getattr(config, "query_pre_attn_scalar", None) or head_dim
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
        self.seq = SequenceState()
        layers = [
            CompressedLayer(
                i,
                n_layers,
                n_kv,
                n_heads // n_kv,
                scaling**-0.5,
                config.sliding_window if layer_types[i] == "sliding_attention" else None,
                self.seq,
            )
            for i in range(n_layers)
        ]
        for layer, inv_freq in zip(layers, layer_frequencies(model_or_config, layer_types, head_dim), strict=True):
            layer.inv_freq = inv_freq
        super().__init__(layers=layers)
        self.layers: list[CompressedLayer] = layers
        self.stack = stack if isinstance(stack, Stack) else Stack.parse(stack)
        self.budget = Budget.parse(budget)
        self.compress_clock = Stopwatch()  # statistics + scoring + gathering, prefill and decode
        # recorded beyond what the stack needs, so that `fork` can serve other stacks
        self.extra_needs, self.extra_window = frozenset(observe), query_window
        # statistics see past a sliding window: KVzip's reconstruction scores the tokens a sliding
        # layer holds by the queries that repeat them, which its window would hide (kvzip.reread)
        self.windowless_statistics = False
        self.source = model_or_config  # the model or config it was built for (forks are built alike)
        self.compressions = 0
        self.peak_nbytes = 0  # the most `nbytes()` read while prompt chunks went in (before each compression)
        self._first_slot: tuple[torch.Tensor | None, int] = (None, 0)  # a forward's slots and their first, on the host
        self.signals: dict[str, dict[int, torch.Tensor]] = {}  # per-layer measurements for allocators
        self.pending_signals: set[int] = set()  # layers whose forward hooks owe a signal (cache/hidden.py)
        self.confidence: torch.Tensor | None = None  # (b,) set by the decoding loop when a method asks
        self.reread_s = 0.0  # seconds of KVzip's re-reading pass over the prompt
        self.holding = False  # inside `held()`: layers compress only when the block ends
        self.last_logits: torch.Tensor | None = None  # (b, vocab) after the last token, when loaded from a file
        self.working_nbytes = 0  # the most bytes a retriever brought back for one attention call
        self.fetched_nbytes = 0  # bytes read back from slow tiers, all calls
        self.fetch_clock = Stopwatch()  # ranking pages and reading them back from slow tiers
        self.policy = Policy(self, self.stack, self.budget, model_or_config, head_dim)  # decides what is kept
        if "hidden_cosine" in self.needs and hasattr(model_or_config, "config"):
            install(model_or_config)  # hooks that measure the hidden states (SqueezeAttention)

    # ---- the transformers Cache API ------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        """Append keys/values (b, h, q, d); return a view the kvstack attention reads."""
        layer = self.layers[layer_idx]
        slots, first = (cache_kwargs or {}).get("cache_position"), None
        if slots is None:
            first = layer.seen
            slots = torch.arange(first, first + key_states.shape[2], device=key_states.device)
        fresh = not layer.is_initialized
        layer.append(key_states, value_states, slots, self.first_slot(slots, first))
        if key_states.shape[2] > 1:
            self.seq.prompt_end = max(self.seq.prompt_end, layer.seen)
        # a layer's first chunk holds exactly these tensors: attention may read them as they came
        view = LayerView(layer, self, slots, (key_states, value_states) if fresh else None)
        return view, view

    def first_slot(self, slots: torch.Tensor, first: int | None = None) -> int:
        """The first of a forward's consecutive slots (q,), read from the device once per forward
        (every layer gets the same tensor), or never when the caller says it (`first`): a decoding
        step on a GPU then never waits for the device."""
        if first is not None:
            self._first_slot = (slots, first)
        elif self._first_slot[0] is not slots:
            self._first_slot = (slots, int(slots[0]))
        return self._first_slot[1]

    def retrieve(self, layer: CompressedLayer, query: torch.Tensor, last: int) -> Fetched | None:
        """Pages of `layer`'s slow tier brought back for `query` (b, h*g, q, d) whose last query
        is slot `last`, on its device, or None without a tier; their bytes are counted as resident
        while attention reads them."""
        started = self.fetch_clock.start(query.device)
        fetched = self.policy.retrieve(layer, query, last)
        self.fetch_clock.stop(started)
        if fetched is None:
            return None
        self.fetched_nbytes += fetched.nbytes
        held = storage_bytes([fetched.keys, fetched.values, fetched.slots])
        self.working_nbytes = max(self.working_nbytes, held)
        device = layer.keys[0].device
        if fetched.keys.device != device:
            fetched.keys, fetched.values = fetched.keys.to(device), fetched.values.to(device)
            fetched.slots = fetched.slots.to(device)
        return fetched

    @property
    def plan(self) -> Any:
        """What `auto` decided for this cache (`kvstack.planning.plan.Plan`), once it compressed; else None."""
        planner = self.policy.shares.planner
        return planner.plan if planner is not None else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Logical length (tokens seen), so new tokens get the right positions after eviction."""
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + cache_position.shape[0], 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.select_batch(beam_idx)
        for name in ("padding", "ends", "ids"):  # per-slot records follow their sequences
            record = getattr(self.seq, name)
            if record is not None:
                setattr(self.seq, name, record[beam_idx.to(record.device)])
        self.policy.shares.forget()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)  # type: ignore[arg-type]

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a compressed cache cannot be cropped (assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a compressed cache cannot be repeated (beam search expansion is not supported)")

    # ---- observation and compression -----------------------------------------------------
    def observe(
        self,
        layer: CompressedLayer,
        query: torch.Tensor,
        query_slots: torch.Tensor,
        padding: torch.Tensor | None,
        window: int | None,
        scale: float,
    ) -> None:
        """Called by the attention after `layer` attended: record what the stack needs, then compress.

        Statistics are billed to `compress_s`: they are work a method causes, not prefill.
        """
        if query.shape[2] > 1:  # a prompt chunk: the cache is at its fullest before this layer compresses
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes())
        window_q, needs = self.query_window if self.policy.reads_queries else 0, self.needs & statistics.STATISTICS
        if window_q or needs:  # else nothing to record, and no clock to read (a GPU step pays per event)
            started = self.compress_clock.start(query.device)
            layer.observe_queries(query.detach(), query_slots, window_q)
            if needs:
                seen = None if self.windowless_statistics else window
                statistics.record(layer, needs, query, query_slots, padding, seen, scale)
            self.compress_clock.stop(started)
        if not self.holding:
            self.policy.maintain(layer, decoding=query.shape[2] == 1)

    @property
    def needs(self) -> frozenset[str]:
        """Statistics recorded after each attention: the stack's and any asked for with `observe`."""
        return self.stack.needs | self.extra_needs

    @property
    def query_window(self) -> int:
        return max(self.stack.query_window, self.extra_window)

    def fork(self, stack: Stack | str, budget: Budget | str | float) -> KVCache:
        """A copy of this cache compressed now under another stack and budget (`forks.fork`)."""
        return forks.fork(self, stack if isinstance(stack, Stack) else Stack.parse(stack), budget)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Inside this block no layer compresses; when it ends, every layer compresses as at the end
        of a prompt chunk. Between the two a probe may lend the layers other queries to score by
        (`probe_fork`, `borrow_queries`)."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        for layer in self.layers:
            if layer.is_initialized:
                self.policy.maintain(layer, decoding=False)

    def probe_fork(self) -> KVCache:
        """A full cache over this cache's tokens recording the queries this cache's stack reads: run
        a question on it, then `borrow_queries` from it (`forks`)."""
        return forks.probe(self)

    def borrow_queries(self, probe: KVCache) -> None:
        """Take the queries each layer of `probe` observed last (and their slots) as this cache's own."""
        forks.borrow_queries(self, probe)

    @contextmanager
    def exempt(self) -> Iterator[None]:
        """Tokens appended inside this block are never evicted and do not count against the budget."""
        start = self.layers[0].seen
        self.seq.exempt.append((start, OPEN_END))  # open while inside: its tokens arrive during the block
        try:
            yield
        finally:
            self.seq.exempt[-1] = (start, self.layers[0].seen)

    def save(self, path: Any, text_sha256: str | None = None, last_logits: torch.Tensor | None = None) -> dict:
        """Write this cache to one file (`kvstack.cache.saved`; `kvstack.load_cache` reads it back);
        the file's header (model, stack, budget, tokens, bytes)."""
        return save(self, path, text_sha256, last_logits)

    # ---- measurement -----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the cache really holds for attention, read off its tensors' storage (storage
        shared by several layers counted once)."""
        reads = getattr(self.stack.retriever, "reads_text", False)
        text = [self.seq.ids] if reads and self.seq.ids is not None else []  # token ids a text retriever ranks by
        return storage_bytes([t for layer in self.layers for t in layer.tensors()] + text) + self.working_nbytes

    def offloaded_nbytes(self) -> int:
        """Bytes the slow tiers hold on disk (a retriever's tokens), outside `nbytes()`."""
        return sum(layer.tier.offloaded_nbytes() for layer in self.layers if layer.tier is not None)

    def aux_nbytes(self) -> int:
        """Bytes of method state (observed queries, attention statistics) on top of `nbytes()`."""
        return sum(layer.aux_nbytes() for layer in self.layers)

    def full_nbytes(self) -> int:
        """Bytes a plain full cache (transformers' dynamic cache) would hold for the same tokens."""
        return sum(layer.full_nbytes() for layer in self.layers if layer.is_initialized)

    def stats(self) -> list[dict[str, Any]]:
        """Per layer and head: tokens held (real ones) and bytes held."""
        return [row for layer in self.layers if layer.is_initialized for row in layer.head_stats()]
