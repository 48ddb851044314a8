"""The policy of one cache: when to compress, which tokens to keep, how to store them.

`KVCache` stores and attends; after each layer's attention it hands the layer to `maintain`,
which trims a sliding window, asks the stack's stages for scores and budgets (`Shares`), turns
them into a `Keep` (plain indices) and has the layer execute it, then encodes the oldest tokens
as the quantizer says. The stages decide; this class only sequences them.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from kvstack.cache.budget import Budget
from kvstack.cache.compensation import compensation_mask, fold
from kvstack.cache.statistics import PROMPT_PASSES
from kvstack.cache.tier import EMPTY_SLOT, NO_PAGE, Fetched, Tier, summary_bytes
from kvstack.errors import UserError
from kvstack.methods.base import Method, Observation, Stage, decode_block, recent_mask
from kvstack.methods.merge.base import merge_states
from kvstack.methods.retrieve.base import resident_share
from kvstack.methods.select import select
from kvstack.policy.shares import Shares
from kvstack.stack import Stack

if TYPE_CHECKING:
    from kvstack.cache.layer import CompressedLayer


class Policy:
    """A stack under a budget, executed on one cache's layers (`cache`: a `KVCache`)."""

    def __init__(self, cache: Any, stack: Stack, budget: Budget, source: Any, head_dim: int) -> None:
        self.cache, self.stack, self.budget = cache, stack, budget
        self.clock = cache.compress_clock
        self.calibration: dict[str, torch.Tensor] = {}  # allocator kind -> table measured on the model
        for allocator in stack.allocators:  # head allocators calibrate on the model once (kvstack.calibrate)
            table = allocator.prepare(source)
            if table is not None:
                self.calibration[allocator.kind] = table
        codecs = demote_codecs = None
        quantizer = stack.quantizer
        if quantizer is not None:
            quantizer.check(head_dim)
            table = quantizer.prepare(source)
            device = getattr(source, "device", None)
            codecs = quantizer.codecs(table.to(device) if table is not None and device is not None else table)
            if stack.demotes:
                demote_codecs = stack.evictor.demote_codecs()
        self.shares = Shares(self, codecs, demote_codecs)
        self.tables = scorer_tables(stack, source)
        if quantizer is not None:
            self.check_alone(quantizer, head_dim, source)
        planner = stack.planner
        if planner is not None:  # `auto` measures the model once and decides at the first compression
            self.shares.planner = planner.planner(source)
        self._prompt_scores: dict[int, tuple[Any, int, torch.Tensor]] = {}  # layer -> a plan's (scorer, seen, scores)
        self.fetch_pages: dict[int, torch.Tensor] = {}  # layer -> (b,) tier pages a head brings back per call

    def check_alone(self, quantizer: Any, head_dim: int, source: Any) -> None:
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
        if self.shares.demote_codecs is not None:
            least = (sum(c.token_bytes(head_dim) for c in self.shares.demote_codecs) + 4) / full  # + the slot
            if least > self.budget.fraction:
                raise UserError(
                    f"{self.stack.label} keeps every token at {quantizer.lo} bits or more, about {least:.3f} of "
                    f"the full bytes, so budget {self.budget} is out of reach: lower lo or raise the budget"
                )
            return
        if self.stack.evictor is not None:
            return
        assert self.shares.codecs is not None
        ratio = sum(c.token_bytes(head_dim) for c in self.shares.codecs) / full
        if ratio > self.budget.fraction:
            raise UserError(
                f"{self.stack.label} stores about {ratio:.3f} of the full bytes and evicts nothing, so budget "
                f"{self.budget} is out of reach: add an eviction stage (snapkv+{self.stack.label}) or use budget 1.0"
            )

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
            started = self.clock.start(layer.keys[0].device)
            joiner.join(self.cache, layer, decoding)
            self.clock.stop(started)

    def _maintain_alone(self, layer: CompressedLayer, decoding: bool) -> None:
        """`maintain` for one layer on its own: evict to the budget, encode the oldest."""
        method = self.stack.evictor
        if method is None or self.budget.is_full:
            self.encode(layer, decoding)
            return
        if self.waiting:
            if decoding:
                raise UserError(
                    f"{self.stack.label} scores by re-reading the prompt, which kvstack's own loop runs: "
                    "use kvstack.generate / `kvstack generate` (model.generate cannot run that pass)"
                )
            return
        if self.stack.whole_prompt and not decoding:
            last = layer.layer_idx == len(self.cache.layers) - 1
            if last and not self.cache.pending_signals:  # else the hidden-state hooks call it (cache/hidden.py)
                self.compress_all()
            return
        self._maintain(layer, decoding)

    @property
    def waiting(self) -> bool:
        """True while a pass over the prompt that the stack (or `observe`) needs has not run yet
        (`statistics.PROMPT_PASSES`: KVzip's reconstruction, run by its `prompt_done` hook)."""
        passes = self.cache.needs & PROMPT_PASSES
        if not passes or (self.stack.evictor is not None and self.budget.is_full):
            return False
        held = [layer for layer in self.cache.layers if layer.is_initialized]
        return not all(name in layer.stats for name in passes for layer in held)

    def compress_all(self) -> None:
        """Compress every layer to its budget now (after the prompt, or after a re-reading pass);
        not while the cache is `held` (it compresses every layer when the block ends)."""
        if self.stack.evictor is None or self.budget.is_full or self.waiting or self.cache.holding:
            return
        if self.stack.whole_prompt:
            started = self.clock.start(self.cache.layers[0].keys[0].device)
            self.shares.reweigh()
            self.clock.stop(started)
            plan = self.shares.plan
            if plan is not None and not self.stack.demotes:  # scores on the same state: score each layer once
                self._prompt_scores = plan.unsplit
        try:
            for layer in self.cache.layers:
                if layer.is_initialized:
                    self._maintain(layer, decoding=False)
        finally:  # the plan's scores are not held past the compression they were computed for
            self._prompt_scores, self.shares.plan = {}, None

    def _maintain(self, layer: CompressedLayer, decoding: bool) -> None:
        method = self.stack.evictor
        assert method is not None
        if decoding and layer.seen <= layer.next_check:  # no head can exceed its share yet
            self.encode(layer, decoding)
            return
        keep = method.limit(self.shares.keep_allowed(layer), decoding, self.cache.confidence)
        if self.stack.retriever is not None:
            keep = self.resident(layer, keep)
        counts = layer.counts(exclude_demoted=self.stack.demotes)
        if any(a.splits for a in self.stack.allocators):  # heads share the layer's total: compare totals
            over = counts.sum(-1) > keep.sum(-1)  # (b,)
        else:
            over = counts > keep  # (b, h); heads within budget keep everything (batch-invariant)
        if bool(over.any()):
            self.compress_layer(layer, keep, decoding)
            counts = layer.counts(exclude_demoted=self.stack.demotes) if self.shares_only_grow else counts
        if self.shares_only_grow:  # each step adds at most one token per head: skip the checks until then
            slack = int((keep - counts).min())
            slack -= self.shares.planner is not None  # a plan's bisection may round a share down by a token
            layer.next_check = layer.seen + slack
        self.encode(layer, decoding)

    def resident(self, layer: CompressedLayer, keep: torch.Tensor) -> torch.Tensor:
        """(b, h) tokens a head of `layer` keeps resident under a retriever, its budget's `keep`
        less the slow tier's index and the pages it brings back (`resident_share`). A sliding
        layer keeps no tier: what leaves its window is never attended again."""
        retriever = self.stack.retriever
        if layer.is_sliding:
            return keep
        full_layers = sum(not other.is_sliding for other in self.cache.layers)
        room = self.shares.room(layer, layer.seen, layer)[0]
        d = layer.keys[0].shape[-1]
        index_bytes = summary_bytes(retriever.summaries, d, retriever.page, layer.keys[0].dtype.itemsize)
        keep = keep - int(retriever.remembers)  # its last choice and query: under a token's bytes (tested)
        keep, pages = resident_share(
            keep, room, retriever.page, retriever.select, layer.token_bytes(), index_bytes, full_layers
        )
        self.fetch_pages[layer.layer_idx] = pages
        return keep

    def retrieve(self, layer: CompressedLayer, query: torch.Tensor, last: int) -> Fetched | None:
        """The pages of `layer`'s slow tier its retriever ranks best for `query` (b, h*g, q, d)
        (the last query at slot `last`: a text retriever reads the token ids up to it), read back
        for this attention call; None when the layer has no tier."""
        tier, retriever = layer.tier, self.stack.retriever
        pages = self.fetch_pages.get(layer.layer_idx)
        k = min(int(pages.max()), tier.n_pages) if tier is not None and pages is not None else 0
        if tier is None or retriever is None or k == 0:
            return None
        b, hg, q, d = query.shape
        grouped = query.reshape(b, tier.heads, (hg // tier.heads) * q, d)
        ids = self.cache.seq.ids if retriever.reads_text else None  # the token ids up to the last query
        text = ids[:, : last + 1].to(query.device) if ids is not None else None
        fresh = None  # (b, h) heads that rank afresh; None: all of them
        if retriever.remembers and q == 1 and tier.chosen is not None and tier.chosen.shape[-1] == k:
            fresh = retriever.stale(grouped, tier.anchor).cpu()
        if fresh is None or bool(fresh.any()):
            chosen = self.choose(layer, grouped, text, pages, k)
            if fresh is not None:  # the other heads keep their last choice
                chosen = torch.where(fresh[..., None], chosen, tier.chosen)
        else:
            chosen = tier.chosen
        if retriever.remembers:
            anchor = grouped.mean(2).to(tier.dtype)
            tier.anchor = (
                anchor if fresh is None else torch.where(fresh.to(anchor.device)[..., None], anchor, tier.anchor)
            )
            tier.chosen = chosen
        fetched = tier.fetch(chosen)
        attended = retriever.refine(grouped, fetched.keys.to(query.device), (fetched.slots >= 0).to(query.device))
        if attended is not None:  # tokens inside the pages left out of this call: masked as empty
            fetched.slots = fetched.slots.masked_fill(~attended.to(fetched.slots.device), EMPTY_SLOT)
        return fetched

    def choose(
        self, layer: CompressedLayer, grouped: torch.Tensor, text: torch.Tensor | None, pages: torch.Tensor, k: int
    ) -> torch.Tensor:
        """(b, h, k) int32 the pages of `layer`'s tier its retriever chooses for queries grouped
        (b, h, g*q, d) by KV head, each row its `pages` (b,) best at most (`NO_PAGE`: none; a
        remembered choice keeps meaning none as the tier grows)."""
        tier, retriever = layer.tier, self.stack.retriever
        valid = tier.page_valid()
        ranks = retriever.rank(grouped, tier.index, text).masked_fill(~valid, float("-inf"))
        ranks = retriever.lead(ranks, self.tables.get(retriever.name), layer.layer_idx).masked_fill(
            ~valid, float("-inf")
        )
        if bool((pages < k).any()):  # a row that brings back fewer pages than the batch's most: its best only
            place = torch.sort(ranks, dim=-1, descending=True, stable=True).indices.argsort(-1)  # (b, h, P)
            ranks = ranks.masked_fill(place >= pages.to(ranks.device)[:, None, None], float("-inf"))
        chosen = retriever.choose(ranks, k)
        n_pages = ranks.shape[-1]
        none = (chosen >= n_pages) | (ranks.gather(-1, chosen.clamp(max=n_pages - 1)) == float("-inf"))
        return chosen.masked_fill(none, NO_PAGE).to(torch.int32).cpu()

    @property
    def reads_queries(self) -> bool:
        """False once `auto`'s plan is decided with no scorer that reads observed queries: the
        cache then stops keeping them (a copy per layer and step, for nothing)."""
        planner = self.shares.planner
        return planner is None or planner.plan is None or planner.query_window > 0

    @cached_property
    def shares_only_grow(self) -> bool:
        """True when no head's share of the budget ever shrinks as tokens arrive: a fraction or a
        token count split uniformly, or by `auto`'s plan over layers that all hold the whole
        context (its shares are rescaled by one factor, which only grows as the floors of its least
        tokens fall; a sliding layer's room stops growing and its share may fall), by a method that
        takes the budget's keep as it is. Then a head `s` tokens under its share cannot exceed it
        in the next `s` slots, and `_maintain` need not look (each look builds the layer's dense view)."""
        evictor = self.stack.evictor
        return (
            evictor is not None
            and self.budget.nbytes is None
            and (self.shares.planner is None or not any(layer.sliding_window for layer in self.cache.layers))
            and not self.stack.allocators
            and not self.stack.demotes
            and not self.stack.compensates
            and self.stack.retriever is None  # its index grows with the tokens it lets go
            and all(type(m).limit is Method.limit for m in evictor.chain() if isinstance(m, Method))
        )

    def encode(self, layer: CompressedLayer, decoding: bool) -> None:
        """Encode each head's oldest tokens held in the model's dtype beyond the quantizer's residual
        window, as `kvstack.cache.window` says (whole groups; a batched group cut short after a prompt)."""
        quantizer = self.stack.quantizer
        if self.shares.planner is not None and self.shares.planner.plan is not None and layer.is_initialized:
            self.shares.planner.encode(self, layer, decoding)
            return
        if self.shares.codecs is None or not layer.is_initialized:
            return
        counts = [self.shares.to_encode(layer.keys[h].shape[1], decoding) for h in range(layer.n_kv_heads)]
        if max(counts) <= 0:  # most steps: no whole group yet, and no clock to read
            return
        started = self.clock.start(layer.keys[0].device)
        codecs = self.shares.codecs
        layer.encode_heads([(h, n, codecs) for h, n in enumerate(counts) if n > 0], quantizer, layer.queries)
        self.clock.stop(started)

    def scorer(self, layer_idx: int) -> Stage:
        """The stage that scores layer `layer_idx`: the evictor, or under `auto` the one its plan gives it."""
        method = self.stack.evictor
        if self.shares.planner is not None and self.shares.planner.plan is not None:
            method = self.shares.planner.scorer(layer_idx)
        assert method is not None
        return method

    def scores(self, obs: Observation) -> torch.Tensor:
        """(b, h, t) the evictor's scores, +inf on exempt tokens (never evicted); under `auto`, the
        scorer its plan gives the layer. Right after the prompt, the scores a whole-prompt
        allocator's plan computed on the same state are reused (the plan scored every layer)."""
        method = self.scorer(obs.layer_idx)
        saved = self._prompt_scores.pop(obs.layer_idx, None)
        if saved is not None and saved[0] is method and saved[1] == obs.seen and not obs.decoding:
            return saved[2]
        scores = method.score(obs)
        if self.cache.seq.exempt:
            scores = torch.where(self.cache.seq.is_exempt(obs.slots), torch.full_like(scores, float("inf")), scores)
        return scores

    def compress_layer(self, layer: CompressedLayer, keep: torch.Tensor, decoding: bool = False) -> None:
        """Ask the stack's evictor for scores and keep about `keep[b, h]` tokens per head.

        Allocators may re-split the layer's total among its heads from the scores. Exempt tokens
        (a query-agnostic question) are never evicted; while decoding, neither are the evictor's
        `decode_window` newest tokens. Heads within their share keep everything.
        """
        method = self.stack.evictor
        assert method is not None
        start = self.clock.start(layer.keys[0].device if layer.keys else None)
        obs = Observation(layer, keep, self.cache.seq.token_index(), decoding, self.cache.confidence, self.tables)
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
            if self.stack.allocators:  # uneven shares: the uniform share sets one cadence for the cache
                # (a layer an allocator left few tokens would otherwise compress every few steps),
                # a head evicting at most half its own share ahead
                uniform = self.shares.uniform(layer)[0].unsqueeze(1).expand_as(keep)
                block = torch.minimum(decode_block(self.stack.every, uniform), (keep // 2).clamp(min=1))
            else:
                block = decode_block(self.stack.every, keep)
            keep = torch.maximum(keep - (block - 1), torch.clamp(counts, max=self.stack.min_tokens))
            # a sequence's heads that would pass their share within the block evict with it, so the
            # layer's heads stay in step: one compression per block, not one per head
            over = over | (counts > keep) & over.any(-1, keepdim=True)
        folding = self.stack.compensates
        if folding:  # the compensation token is kept, and one place is left for a new one
            token = compensation_mask(layer, obs.slots)
            scores = torch.where(token, torch.full_like(scores, float("inf")), scores)
            protected = token if protected is None else protected | token
            keep = torch.where(over & ~token.any(-1), (keep - 1).clamp(min=1), keep)
        keep = torch.where(over, keep, counts)
        obs.keep = keep
        decision = select(scores, obs.valid, obs.slots, keep, protected)
        retriever = self.stack.retriever
        if folding or self.stack.merger is not None or retriever is not None:
            kept = torch.zeros_like(obs.valid)
            real = torch.arange(decision.index.shape[-1], device=kept.device) < decision.count.unsqueeze(-1)
            kept.scatter_(-1, decision.index, real)
        if folding:
            dropped = obs.valid & ~kept
            dense_keys, dense_values, dense_slots = obs.keys, obs.values, obs.slots
        if self.stack.merger is not None:
            self.merge(layer, obs, kept)
        if retriever is not None and not layer.is_sliding:  # what is not kept resident moves to the slow tier
            if layer.tier is None:
                b, h, _, d = obs.keys.shape
                dtype, page, summaries = layer.keys[0].dtype, retriever.page, retriever.summaries
                layer.tier = Tier(b, h, d, dtype, page, obs.keys.device, summaries, retriever.bits, retriever.store)
            moved = obs.valid & ~kept
            prompt = (obs.slots >= 0) & (obs.slots < obs.prompt_end)
            layer.tier.append(obs.keys, obs.values, obs.slots, moved, retriever.arrange(obs.keys, moved, prompt))
        layer.apply(decision, self.shares.demote_codecs)
        if folding:
            fold(layer, dropped, dense_keys, dense_values, dense_slots)
        self.clock.stop(start)
        self.cache.compressions += 1

    def merge(self, layer: CompressedLayer, obs: Observation, kept: torch.Tensor) -> None:
        """Fold the tokens a selection leaves out (not `kept`, (b, h, t)) into kept ones, as the
        stack's merging stage decides; only entries held in the model's dtype are rewritten."""
        merger = self.stack.merger
        plan = merger.merge(obs, kept).into(obs.plain & kept)
        keys, values, log_count, changed = merge_states(obs.keys, obs.values, obs.log_count, plan)
        layer.rewrite(changed, keys, values, log_count if merger.log_count else None)


def scorer_tables(stack: Stack, source: Any) -> dict[str, Any]:
    """Scorer name -> what it loads from the model once (`Method.load`), for each scorer of the
    stack's evictor (a wrapped one included) and of its planner (`auto`'s candidates)."""
    tables: dict[str, Any] = {}
    stages = stack.evictor.chain() if stack.evictor is not None else []
    if stack.planner is not None:
        stages += list(stack.planner.methods.values())
    for stage in stages:
        if isinstance(stage, Method):
            table = stage.load(source)
            if table is not None:
                tables[stage.name] = table
    return tables
