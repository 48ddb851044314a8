"""`KVCache`: the transformers `Cache` that kvstack owns, executing a method stack's decisions.

Use it as `past_key_values` with `model.generate` or plain forward calls on a model loaded
with `attn_implementation="kvstack"`. After each layer's attention it trims sliding windows
and, when a head holds more than its budget allows, asks the stack which tokens to keep and
gathers them into smaller tensors: memory is freed for real and `nbytes()` reads it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvstack.cache import statistics
from kvstack.cache.attention import ATTENTION, LayerView, register
from kvstack.cache.budget import Budget, Cost, full_precision_room, tokens_to_keep, unaffordable
from kvstack.cache.encoded import Codec
from kvstack.cache.layer import CompressedLayer, SequenceState, storage_bytes
from kvstack.errors import UserError
from kvstack.methods.base import Method, Observation, decode_block, recent_mask
from kvstack.methods.select import select
from kvstack.models.rope import layer_frequencies
from kvstack.stack import Stack
from kvstack.timing import Stopwatch

register()
OPEN_END = 2**62


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs keep it under `text_config`)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
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
        self.calibration: dict[str, torch.Tensor] = {}  # allocator kind -> table measured on the model
        for allocator in self.stack.allocators:  # head allocators calibrate on the model once (kvstack.calibrate)
            table = allocator.prepare(model_or_config)
            if table is not None:
                self.calibration[allocator.kind] = table
        self.planner = next((s for s in self.stack.selection if s.family == "auto"), None)  # `auto`
        self.measured: Any = self.planner.prepare(model_or_config) if self.planner is not None else None
        self.plan: Any = None  # what `auto` decided (kvstack.planning.plan.Plan), at the first compression
        self._shares: tuple[int, torch.Tensor] | None = None  # (seen, (b, L, h) byte shares) memo
        self._budgets: tuple[int, list[Budget]] | None = None  # (seen, each sequence's budget) memo
        self.codecs: tuple[Codec, Codec] | None = None  # how tokens beyond the residual window are stored
        self.demote_codecs: tuple[Codec, Codec] | None = None  # how tokens a selection leaves out are (MiKV)
        self._cost: Cost | None = None  # bytes per token by how it is stored (`cost`), once tokens exist
        quantizer = self.stack.quantizer
        if quantizer is not None:
            quantizer.check(head_dim)
            table = quantizer.prepare(model_or_config)
            device = getattr(model_or_config, "device", None)
            self.codecs = quantizer.codecs(table.to(device) if table is not None and device is not None else table)
            if self.stack.demotes:
                self.demote_codecs = self.stack.evictor.demote_codecs()
            self._check_alone(quantizer, head_dim, model_or_config)
        # recorded beyond what the stack needs, so that `fork` can serve other stacks
        self.extra_needs, self.extra_window = frozenset(observe), query_window
        # statistics see past a sliding window: KVzip's reconstruction scores the tokens a sliding
        # layer holds by the queries that repeat them, which its window would hide (generate._reread)
        self.windowless_statistics = False
        self._source = model_or_config
        self.compress_clock = Stopwatch()  # statistics + scoring + gathering, prefill and decode
        self.compressions = 0
        self.peak_nbytes = 0  # the most `nbytes()` read while prompt chunks went in (before each compression)
        self.signals: dict[str, dict[int, torch.Tensor]] = {}  # per-layer measurements for allocators
        self.pending_signals: set[int] = set()  # layers whose forward hooks owe a signal (cache/hidden.py)
        self.weights: torch.Tensor | None = None  # (L, b, h) budget weights decided by the allocators
        self.confidence: torch.Tensor | None = None  # (b,) set by the decoding loop when a method asks
        self.reread_s = 0.0  # seconds of KVzip's re-reading pass over the prompt
        self._allocation: tuple[int, torch.Tensor] | None = None  # (seen, (L, b, h) keep) memo
        if "hidden_cosine" in self.needs and hasattr(model_or_config, "config"):
            from kvstack.cache.hidden import install

            install(model_or_config)  # hooks that measure the hidden states (SqueezeAttention)

    def _check_alone(self, quantizer: Any, head_dim: int, source: Any) -> None:
        """One-line error when a stack that keeps every token (a quantizer without eviction, or
        MiKV's low precision) cannot reach the budget."""
        if self.budget.nbytes is not None and self.stack.evictor is None:
            raise UserError(
                f"{self.stack.label} evicts nothing, so it cannot hold a byte budget ({self.budget}): add an "
                f"eviction stage (snapkv+{self.stack.label}) or give a fraction"
            )
        if self.budget.fraction is None or self.budget.is_full:
            return
        full = 2 * head_dim * getattr(source, "dtype", torch.bfloat16).itemsize
        if self.demote_codecs is not None:
            least = (sum(c.token_bytes(head_dim) for c in self.demote_codecs) + 4) / full  # + the slot
            if least > self.budget.fraction:
                raise UserError(
                    f"{self.stack.label} keeps every token at {quantizer.lo} bits or more, about {least:.3f} of "
                    f"the full bytes, so budget {self.budget} is out of reach: lower lo or raise the budget"
                )
            return
        if self.stack.evictor is not None:
            return
        assert self.codecs is not None
        ratio = sum(c.token_bytes(head_dim) for c in self.codecs) / full
        if ratio > self.budget.fraction:
            raise UserError(
                f"{self.stack.label} stores about {ratio:.3f} of the full bytes and evicts nothing, so budget "
                f"{self.budget} is out of reach: add an eviction stage (snapkv+{self.stack.label}) or use budget 1.0"
            )

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
        slots = (cache_kwargs or {}).get("cache_position")
        if slots is None:
            slots = torch.arange(layer.seen, layer.seen + key_states.shape[2], device=key_states.device)
        fresh = not layer.is_initialized
        layer.append(key_states, value_states, slots)
        if key_states.shape[2] > 1:
            self.seq.prompt_end = max(self.seq.prompt_end, layer.seen)
        # a layer's first chunk holds exactly these tensors: attention may read them as they came
        view = LayerView(layer, self, slots, (key_states, value_states) if fresh else None)
        return view, view

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
        if self.seq.padding is not None:
            self.seq.padding = self.seq.padding[beam_idx]

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
        started = self.compress_clock.start(query.device)
        layer.observe_queries(query.detach(), query_slots, self.query_window)
        needs = self.needs & statistics.STATISTICS
        if needs:
            seen = None if self.windowless_statistics else window
            statistics.record(layer, needs, query, query_slots, padding, seen, scale)
        self.compress_clock.stop(started)
        self.maintain(layer, decoding=query.shape[2] == 1)

    @property
    def needs(self) -> frozenset[str]:
        """Statistics recorded after each attention: the stack's and any asked for with `observe`."""
        return self.stack.needs | self.extra_needs

    @property
    def query_window(self) -> int:
        return max(self.stack.query_window, self.extra_window)

    def fork(self, stack: Stack | str, budget: Budget | str | float) -> KVCache:
        """A copy of this cache compressed now under another stack and budget; this cache is unchanged.

        Prefill once, fork per method: in query-agnostic mode this gives the same cache as
        compressing during prefill (prefill outputs never depend on the cache's compression).
        """
        stack = stack if isinstance(stack, Stack) else Stack.parse(stack)
        missing = stack.needs - self.needs
        if missing or stack.query_window > self.query_window:
            raise ValueError(
                f"this cache did not record what {stack} needs ({', '.join(sorted(missing)) or 'queries'}): "
                f"build it with KVCache(..., observe={set(stack.needs)}, query_window={stack.query_window})"
            )
        new = KVCache(self._source, stack, budget)
        new.seq = self.seq.copy()
        new.signals = {name: dict(per_layer) for name, per_layer in self.signals.items()}
        new.confidence = self.confidence
        new.layers[:] = [layer.copy(new.seq, stack.needs, stack.query_window) for layer in self.layers]
        for layer in new.layers:
            if layer.is_initialized:
                new.maintain(layer, decoding=False)
        return new

    def uniform(
        self, layer: CompressedLayer, seen: int | None = None, like: CompressedLayer | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(base, room, exempt), each (b,): tokens each head keeps under a uniform split of the
        budget, the evictable tokens a full cache would hold, and the exempt ones it holds on top,
        after `seen` slots. `like` lends batch, device and token bytes to a layer the prompt has
        not reached yet."""
        ref = like or layer
        seen = layer.seen if seen is None else seen
        room, n_exempt = self._room(layer, seen, ref)
        cost = self.cost(ref)
        budgets = self.budgets_at(seen, ref)
        if self.codecs is not None:
            for b, budget in enumerate(budgets):
                self._check_affordable(int(room[b]), cost, budget)
        if len(set(budgets)) == 1:
            return tokens_to_keep(budgets[0], room, cost), room, n_exempt
        base = torch.cat([tokens_to_keep(budget, room[b : b + 1], cost) for b, budget in enumerate(budgets)])
        return base, room, n_exempt

    def _room(self, layer: CompressedLayer, seen: int, ref: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """(room, exempt), both (b,): evictable tokens a full cache holds in `layer` after `seen`
        slots, and the exempt ones on top (`ref` lends batch and device)."""
        n_full = self.seq.real_counts(seen, ref.batch, device=ref.keys[0].device)
        n_exempt = self.n_exempt(ref, seen)
        if layer.sliding_window:  # a full sliding layer holds its last window - 1 real tokens
            n_full = torch.clamp(n_full, max=layer.sliding_window - 1)
            n_exempt = torch.minimum(n_exempt, n_full)
        return n_full - n_exempt, n_exempt

    def budgets_at(self, seen: int, ref: CompressedLayer) -> list[Budget]:
        """The budget of each sequence as the cache applies it after `seen` slots: a byte budget
        (`64MB`, per sequence) becomes the fraction of that sequence's full evictable bytes it pays
        for now (memoised per step); one-line error when it cannot pay for the fewest tokens the
        stack keeps per head."""
        if self.budget.nbytes is None:
            return [self.budget] * ref.batch
        if self._budgets is not None and self._budgets[0] == seen:
            return self._budgets[1]
        rooms = torch.stack([self._room(layer, seen, ref)[0] for layer in self.layers]).cpu()  # (L, b)
        full, heads = ref.token_bytes(explicit_slots=False), ref.n_kv_heads
        least = float(torch.clamp(rooms, max=self.stack.min_tokens).sum(0).max()) * ref.token_bytes() * heads
        if self.budget.nbytes < least:
            from kvstack.cache.budget import size_text

            raise UserError(
                f"budget {self.budget} is below the smallest cache {self.stack.label} can hold for "
                f"{int(rooms.max())} tokens ({self.stack.min_tokens} tokens per head, {size_text(least)}): "
                f"use a budget of at least {size_text(least)}"
            )
        budgets = [self.budget.resolve(float(row.sum()) * full * heads) for row in rooms.T]
        self._budgets = (seen, budgets)
        return budgets

    def _check_affordable(self, n_full: int, cost: Cost, budget: Budget) -> None:
        """One-line error when the budget cannot pay a quantizer's fixed costs at this length."""
        quantizer = self.stack.quantizer
        what = unaffordable(budget, n_full, cost)
        if what is None or quantizer is None:
            return
        if what == "fixed":
            raise UserError(
                f"{quantizer.name}'s tables take {cost.fixed:.0f} bytes per head, more than budget {self.budget} "
                f"pays for at {n_full} tokens: use smaller tables (e.g. cq(channels=2)) or a larger budget"
            )
        affordable = full_precision_room(budget, n_full, cost)
        group = self.token_group
        fits = [r for r in (128, 64, 32, 16, 8, 0) if r + group - 1 <= affordable / 2 and r < quantizer.residual]
        fits = fits or ([0] if quantizer.residual > 0 else [])  # the smallest window, the last thing to try
        fix = f"use {quantizer.name}(residual={fits[0]}) or a larger budget" if fits else "use a larger budget"
        raise UserError(
            f"{quantizer.name}'s residual window ({quantizer.residual} tokens, + {group - 1} waiting for a full "
            f"group) is larger than budget {self.budget} at {n_full} tokens ({affordable:.0f} tokens at full "
            f"precision): {fix}"
        )

    def cost(self, layer: CompressedLayer) -> Cost:
        """What a token of `layer` costs by how the stack stores it (see `Cost`); the same for
        every layer and step of this cache, so computed once."""
        if self._cost is None:
            full = layer.token_bytes(explicit_slots=False)
            slot = layer.token_bytes() - full
            if self.stack.merger is not None and self.stack.merger.log_count:
                slot += 4  # the float32 log-count of a merged entry
            if self.codecs is None:
                self._cost = Cost(full, full + slot)
            else:
                d = layer.keys[0].shape[-1]
                kept = sum(c.token_bytes(d) for c in self.codecs) + slot
                residual = self.stack.quantizer.residual + self.token_group - 1
                dropped = sum(c.token_bytes(d) for c in self.demote_codecs) + slot if self.demote_codecs else 0.0
                fixed = sum(c.fixed_bytes(d) for c in (*self.codecs, *(self.demote_codecs or ())))
                self._cost = Cost(full, kept, residual, full + slot, dropped, fixed)
        return self._cost

    @property
    def token_group(self) -> int:
        """Tokens the quantizer encodes together (a group shares metadata); 1 without one."""
        return max((c.token_group for c in self.codecs), default=1) if self.codecs else 1

    def n_exempt(self, layer: CompressedLayer, seen: int | None = None) -> torch.Tensor:
        """(b,) exempt real tokens among the first `seen` slots."""
        seen = layer.seen if seen is None else seen
        n = torch.zeros(layer.batch, dtype=torch.long, device=layer.keys[0].device)
        for start, end in self.seq.exempt:
            if min(end, seen) > start:
                n += self.seq.real_counts(min(end, seen), layer.batch, start, device=n.device)
        return n

    def keep_allowed(self, layer: CompressedLayer) -> torch.Tensor:
        """(b, h) tokens each head may hold now under the budget (exempt tokens come on top).

        Uniform across layers and heads, unless the stack's allocators weighed them: then the
        same total is shared by `distribute` over every layer and head.
        """
        b, h = layer.batch, layer.n_kv_heads
        base, room, n_exempt = self.uniform(layer)
        keep = base.unsqueeze(1).expand(b, h)
        if self.planner is not None:
            keep = self.planned_keep(layer, room)
        if self.stack.allocators:
            weights = self.allocation_weights()
            if weights is not None:
                keep = self.allocation(layer.seen, weights)[layer.layer_idx]
        keep = torch.maximum(keep, torch.clamp(room, max=self.stack.min_tokens).unsqueeze(1))
        return keep + n_exempt.unsqueeze(1)

    def planned_keep(self, layer: CompressedLayer, room: torch.Tensor) -> torch.Tensor:
        """(b, h) tokens each head of `layer` keeps under `auto`'s plan: its byte share of its full
        bytes (rescaled per sequence as it grows, so each sequence holds its budget), at its
        storage; everything when the budget pays for the full cache."""
        from kvstack.planning.options import cost
        from kvstack.planning.plan import keep_tokens

        shares = self.plan_shares(layer)[:, layer.layer_idx]  # (b, h)
        full = layer.token_bytes(explicit_slots=False)
        slot, d = layer.token_bytes() - full, layer.keys[0].shape[-1]
        keep = room.unsqueeze(1).expand(-1, layer.n_kv_heads).clone()
        for h in range(layer.n_kv_heads):
            head_cost = cost(self.plan.storage(layer.layer_idx, h), d, full, slot)
            for b in range(layer.batch):
                if float(shares[b].min()) < 1.0:
                    keep[b, h] = keep_tokens(float(shares[b, h]), int(room[b]), head_cost, self.stack.min_tokens)
        return keep

    def plan_shares(self, layer: CompressedLayer) -> torch.Tensor:
        """(b, L, h) each sequence's byte share per head now (all 1 when its budget pays for the
        full cache); `auto` decides its plan at the first call, at the longest sequence's budget
        (memoised per step)."""
        seen = layer.seen
        if self._shares is not None and self._shares[0] == seen:
            return self._shares[1]
        like = next(x for x in self.layers if x.is_initialized)
        if self.budget.tokens is not None:
            raise UserError(f"auto plans bytes: give a fraction (0.25) or a size (64MB), not {self.budget}")
        rooms = torch.stack([self._room(x, seen, like)[0] for x in self.layers]).cpu()  # (L, b)
        full, heads = like.token_bytes(explicit_slots=False), like.n_kv_heads
        fractions = [float(budget.fraction or 1.0) for budget in self.budgets_at(seen, like)]
        if self.plan is None:
            layout = self.planner.layout(self._source, like.keys[0].element_size(), self.budget)
            longest = int(rooms.sum(0).argmax())
            self.plan = self.planner.decide(self.measured, rooms[:, longest], fractions[longest], layout)
        shares = [
            self.plan.shares_now(n, f * float(n.sum()) * heads * full) if f < 1.0 else torch.ones(len(n), heads)
            for n, f in zip(rooms.T, fractions, strict=True)
        ]
        self._shares = (seen, torch.stack([x.double() for x in shares]))
        return self._shares[1]

    def allocation_weights(self) -> torch.Tensor | None:
        """(L, b, h) the allocators' weights: decided after the prompt (whole-prompt allocators)
        or on first use (a priori ones such as pyramid); None while not yet decided."""
        if self.weights is None and not self.stack.whole_prompt:
            self.weights = self.weigh()
        return self.weights

    def weigh(self) -> torch.Tensor | None:
        """Ask every allocator of the stack for weights over all layers; their product."""
        from kvstack.methods.allocate.base import Plan

        base, room = self._uniform_all(max(layer.seen for layer in self.layers))
        plan = Plan(self, base[..., 0], room[..., 0])
        out = None
        for allocator in self.stack.allocators:
            w = allocator.weights(plan)
            if w is not None:
                out = w.double() if out is None else out * w.double()
        return out

    def _uniform_all(self, seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(base, room), both (L, b, h): the uniform split of every layer after `seen` slots."""
        like = next(layer for layer in self.layers if layer.is_initialized)
        pairs = [self.uniform(layer, seen, like) for layer in self.layers]
        h = self.layers[0].n_kv_heads
        base = torch.stack([p[0] for p in pairs]).unsqueeze(-1).expand(-1, -1, h)
        room = torch.stack([p[1] for p in pairs]).unsqueeze(-1).expand(-1, -1, h)
        return base, room

    def allocation(self, seen: int, weights: torch.Tensor) -> torch.Tensor:
        """(L, b, h) tokens per layer and head after `seen` slots, shared by the weights (memoised
        per step: every layer of a step reads the same allocation)."""
        from kvstack.methods.allocate.base import distribute

        if self._allocation is None or self._allocation[0] != seen:
            base, room = self._uniform_all(seen)
            least = self.stack.min_tokens
            self._allocation = (seen, distribute(weights.to(base.device), base, room, least))
        return self._allocation[1]

    def maintain(self, layer: CompressedLayer, decoding: bool) -> None:
        """Trim the sliding window, then evict down to the budget if a head exceeds it.

        With a whole-prompt allocator, a prompt is compressed once it has reached the last layer:
        the allocator weighs all layers, then every layer is compressed to its share. A method
        that scores by re-reading the prompt (KVzip) waits for `compress_all` after that pass.
        """
        layer.trim_window()
        self._maintain_alone(layer, decoding)
        joiner = self.stack.joiner
        if joiner is not None and not self.waiting:
            started = self.compress_clock.start(layer.keys[0].device)
            joiner.join(self, layer, decoding)
            self.compress_clock.stop(started)

    def _maintain_alone(self, layer: CompressedLayer, decoding: bool) -> None:
        """`maintain` for one layer on its own: evict to the budget, encode the oldest."""
        method = self.stack.evictor
        if method is None or self.budget.is_full:
            self.encode(layer)
            return
        if self.waiting:
            if decoding:
                raise UserError(
                    f"{self.stack.label} scores by re-reading the prompt, which kvstack's own loop runs: "
                    "use kvstack.generate / `kvstack generate` (model.generate cannot run that pass)"
                )
            return
        if self.stack.whole_prompt and not decoding:
            if layer.layer_idx == len(self.layers) - 1 and not self.pending_signals:  # else hidden.py calls it
                self.compress_all()
            return
        self._maintain(layer, decoding)

    @property
    def waiting(self) -> bool:
        """True while a pass over the prompt that the stack (or `observe`) needs has not run yet:
        KVzip's reconstruction, which the decoding loop runs after each prompt chunk."""
        if "reconstruction" not in self.needs or (self.stack.evictor is not None and self.budget.is_full):
            return False
        return not all("reconstruction" in layer.stats for layer in self.layers if layer.is_initialized)

    def compress_all(self) -> None:
        """Compress every layer to its budget now (after the prompt, or after a re-reading pass)."""
        if self.stack.evictor is None or self.budget.is_full or self.waiting:
            return
        if self.stack.whole_prompt:
            started = self.compress_clock.start(self.layers[0].keys[0].device)
            self.weights, self._allocation = self.weigh(), None
            self.compress_clock.stop(started)
        for layer in self.layers:
            if layer.is_initialized:
                self._maintain(layer, decoding=False)

    def _maintain(self, layer: CompressedLayer, decoding: bool) -> None:
        method = self.stack.evictor
        assert method is not None
        if decoding and layer.seen <= layer.next_check:  # no head can exceed its share yet
            self.encode(layer)
            return
        keep = method.limit(self.keep_allowed(layer), decoding, self.confidence)
        counts = layer.counts(exclude_demoted=self.stack.demotes)
        if any(a.splits for a in self.stack.allocators):  # heads share the layer's total: compare totals
            over = counts.sum(-1) > keep.sum(-1)  # (b,)
        else:
            over = counts > keep  # (b, h); heads within budget keep everything (batch-invariant)
        if bool(over.any()):
            self.compress_layer(layer, keep, decoding)
            counts = layer.counts(exclude_demoted=self.stack.demotes) if self.shares_only_grow else counts
        if self.shares_only_grow:  # each step adds at most one token per head: skip the checks until then
            layer.next_check = layer.seen + int((keep - counts).min())
        self.encode(layer)

    @cached_property
    def shares_only_grow(self) -> bool:
        """True when no head's share of the budget ever shrinks as tokens arrive: a fraction or a
        token count split uniformly, by a method that takes the budget's keep as it is. Then a head
        `s` tokens under its share cannot exceed it in the next `s` slots, and `_maintain` need not
        look (each look builds the layer's dense view)."""
        evictor = self.stack.evictor
        return (
            evictor is not None
            and self.budget.nbytes is None
            and self.planner is None
            and not self.stack.allocators
            and not self.stack.demotes
            and not self.stack.compensates
            and all(type(m).limit is Method.limit for m in evictor.chain() if isinstance(m, Method))
        )

    def encode(self, layer: CompressedLayer) -> None:
        """Encode each head's oldest tokens held in the model's dtype beyond the quantizer's residual
        window, in whole groups (the quantizer's token group)."""
        quantizer, group = self.stack.quantizer, self.token_group
        if self.plan is not None and layer.is_initialized:
            self._encode_planned(layer)
            return
        if self.codecs is None or not layer.is_initialized:
            return
        started = self.compress_clock.start(layer.keys[0].device)
        for h in range(layer.n_kv_heads):
            extra = layer.keys[h].shape[1] - quantizer.residual
            count = extra // group * group
            if count > 0:
                g = layer.groups
                queries = layer.queries[:, h * g : (h + 1) * g] if layer.queries is not None else None
                layer.encode_oldest(h, count, quantizer, self.codecs, queries)
        self.compress_clock.stop(started)

    def _encode_planned(self, layer: CompressedLayer) -> None:
        """`encode` under `auto`'s plan: each head by its own storage and residual window."""
        from kvstack.methods.quantize.base import Quantizer
        from kvstack.planning.options import GROUP, codecs

        started = self.compress_clock.start(layer.keys[0].device)
        for h in range(layer.n_kv_heads):
            storage = self.plan.storage(layer.layer_idx, h)
            pair = codecs(storage, layer.keys[h].shape[-1])
            count = (layer.keys[h].shape[1] - storage.residual) // GROUP * GROUP
            if pair is not None and count > 0:
                layer.encode_oldest(h, count, Quantizer(), pair, None)
        self.compress_clock.stop(started)

    def scores(self, obs: Observation) -> torch.Tensor:
        """(b, h, t) the evictor's scores, +inf on exempt tokens (never evicted); under `auto`, the
        scorer its plan gives the layer."""
        method = self.stack.evictor
        if self.plan is not None:
            method = self.planner.methods[self.plan.scorers[obs.layer_idx]]
        assert method is not None
        scores = method.score(obs)
        if self.seq.exempt:
            scores = torch.where(self.seq.is_exempt(obs.slots), torch.full_like(scores, float("inf")), scores)
        return scores

    def compress_layer(self, layer: CompressedLayer, keep: torch.Tensor, decoding: bool = False) -> None:
        """Ask the stack's evictor for scores and keep about `keep[b, h]` tokens per head.

        Allocators may re-split the layer's total among its heads from the scores. Exempt tokens
        (a query-agnostic question) are never evicted; while decoding, neither are the evictor's
        `decode_window` newest tokens. Heads within their share keep everything.
        """
        method = self.stack.evictor
        assert method is not None
        start = self.compress_clock.start(layer.keys[0].device if layer.keys else None)
        obs = Observation(layer, keep, self.seq.token_index(), decoding, self.confidence)
        if self.stack.demotes:  # tokens already at low precision stay there, outside the selection
            obs.valid = obs.valid & ~layer.dense_demoted()
        scores = self.scores(obs)
        protected = None
        if decoding and self.stack.decode_window:
            protected = recent_mask(obs, self.stack.decode_window)
            scores = torch.where(protected, torch.full_like(scores, float("inf")), scores)
        for allocator in self.stack.allocators:
            keep = allocator.split(scores, obs.valid, keep)
        keep = torch.maximum(keep, torch.clamp(obs.valid.sum(-1), max=self.stack.min_tokens))
        counts = obs.valid.sum(-1)
        over = counts > keep  # heads within their share keep everything (batch-invariant)
        if decoding:  # evict a block ahead so the next steps fit (the budget holds at each of them)
            block = decode_block(self.stack.every, keep)
            keep = torch.maximum(keep - (block - 1), torch.clamp(counts, max=self.stack.min_tokens))
        folding = self.stack.compensates
        if folding:  # the compensation token is kept, and one place is left for a new one
            token = layer.compensation_mask(obs.slots)
            scores = torch.where(token, torch.full_like(scores, float("inf")), scores)
            protected = token if protected is None else protected | token
            keep = torch.where(over & ~token.any(-1), (keep - 1).clamp(min=1), keep)
        keep = torch.where(over, keep, counts)
        obs.keep = keep
        decision = select(scores, obs.valid, obs.slots, keep, protected)
        if folding or self.stack.merger is not None:
            kept = torch.zeros_like(obs.valid)
            real = torch.arange(decision.index.shape[-1], device=kept.device) < decision.count.unsqueeze(-1)
            kept.scatter_(-1, decision.index, real)
        if folding:
            dropped = obs.valid & ~kept
            dense_keys, dense_values, dense_slots = obs.keys, obs.values, obs.slots
        if self.stack.merger is not None:
            self.merge(layer, obs, kept)
        layer.apply(decision, self.demote_codecs)
        if folding:
            layer.fold(dropped, dense_keys, dense_values, dense_slots)
        self.compress_clock.stop(start)
        self.compressions += 1

    def merge(self, layer: CompressedLayer, obs: Observation, kept: torch.Tensor) -> None:
        """Fold the tokens a selection leaves out (not `kept`, (b, h, t)) into kept ones, as the
        stack's merging stage decides; only entries held in the model's dtype are rewritten."""
        from kvstack.methods.merge.base import merge_states

        merger = self.stack.merger
        plan = merger.merge(obs, kept).into(obs.plain & kept)
        keys, values, log_count, changed = merge_states(obs.keys, obs.values, obs.log_count, plan)
        layer.rewrite(changed, keys, values, log_count if merger.log_count else None)

    @contextmanager
    def exempt(self) -> Iterator[None]:
        """Tokens appended inside this block are never evicted and do not count against the budget."""
        start = self.layers[0].seen
        self.seq.exempt.append((start, OPEN_END))  # open while inside: its tokens arrive during the block
        try:
            yield
        finally:
            self.seq.exempt[-1] = (start, self.layers[0].seen)

    # ---- measurement -----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the cache really holds for attention, read off its tensors' storage (storage
        shared by several layers counted once)."""
        return storage_bytes([t for layer in self.layers for t in layer.tensors()])

    def aux_nbytes(self) -> int:
        """Bytes of method state (observed queries, attention statistics) on top of `nbytes()`."""
        return sum(layer.aux_nbytes() for layer in self.layers)

    def full_nbytes(self) -> int:
        """Bytes a plain full cache (transformers' dynamic cache) would hold for the same tokens."""
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            held = min(layer.seen, layer.sliding_window - 1) if layer.sliding_window else layer.seen
            total += layer.batch * layer.n_kv_heads * held * layer.token_bytes(explicit_slots=False)
        return total

    def stats(self) -> list[dict[str, Any]]:
        """Per layer and head: tokens held (real ones) and bytes held."""
        rows = []
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            counts = layer.counts()
            for h in range(layer.n_kv_heads):
                rows.append(
                    {
                        "layer": layer.layer_idx,
                        "head": h,
                        "sliding": layer.is_sliding,
                        "tokens": counts[:, h].tolist(),
                        "slots": layer.head_len(h),
                        "bytes": layer.head_nbytes(h),
                    }
                )
        return rows
