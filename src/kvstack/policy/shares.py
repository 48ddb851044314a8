"""How many tokens each head may hold: the budget split over layers, heads and sequences.

A fraction, a token count or a byte size (per sequence) becomes tokens per head at a token's
cost as the stack stores it; allocators re-weigh the split over layers and heads; `auto`'s
planner gives each head its own share. Pure bookkeeping over the cache's counts: nothing here
touches a tensor the cache holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvstack.cache.budget import Budget, Cost, full_precision_room, size_text, tokens_to_keep, unaffordable
from kvstack.cache.encoded import Codec
from kvstack.cache.window import plain_window, to_encode
from kvstack.errors import UserError
from kvstack.methods.allocate.base import Plan, distribute
from kvstack.stack import Stack

if TYPE_CHECKING:
    from kvstack.cache.layer import CompressedLayer


class Shares:
    """The budget's split for one cache (`policy` lends the stack, the budget and the cache's
    layers and sequence state)."""

    def __init__(
        self, policy: Any, codecs: tuple[Codec, Codec] | None, demote_codecs: tuple[Codec, Codec] | None
    ) -> None:
        self.policy, self.cache = policy, policy.cache
        self.stack: Stack = policy.stack
        self.budget: Budget = policy.budget
        self.codecs = codecs  # how tokens beyond the residual window are stored
        self.demote_codecs = demote_codecs  # how tokens a selection leaves out are stored (MiKV)
        self.plan: Plan | None = None  # the last plan the allocators weighed (its scores, per layer)
        self.planner: Any = None  # `auto`'s planner for this cache (planning/auto.py `Planner`), if any
        self.weights: torch.Tensor | None = None  # (L, b, h) budget weights decided by the allocators
        self._cost: Cost | None = None  # bytes per token by how it is stored, once tokens exist
        self._budgets: tuple[int, list[Budget]] | None = None  # (seen, each sequence's budget) memo
        self._allocation: tuple[int, torch.Tensor] | None = None  # (seen, (L, b, h) keep) memo
        self._uniform: tuple[int, dict[int | None, Any]] | None = None  # (seen, window -> `uniform`) memo

    def forget(self) -> None:
        """Drop the memos of this step (the batch's rows were reordered: `KVCache.reorder_cache`)."""
        self._budgets = self._allocation = self._uniform = None
        if self.planner is not None:
            self.planner.forget()

    def keep_allowed(self, layer: CompressedLayer, seen: int | None = None) -> torch.Tensor:
        """(b, h) tokens each head may hold now (or after `seen` slots, the tokens to come real)
        under the budget (exempt tokens come on top).

        Uniform across layers and heads, unless the stack's allocators weighed them: then the
        same total is shared by `distribute` over every layer and head. An `auto` plan answers
        for the layer's own count of slots only.
        """
        b, h = layer.batch, layer.n_kv_heads
        seen = layer.seen if seen is None else seen
        base, room, n_exempt = self.uniform(layer, seen)
        keep = base.unsqueeze(1).expand(b, h)
        if self.planner is not None:
            assert seen == layer.seen, "an auto plan's shares are for the layer's own slots"
            keep = self.planner.keep(self, layer)
        if self.stack.allocators:
            weights = self.allocation_weights()
            if weights is not None:
                keep = self.allocation(seen, weights)[layer.layer_idx]
        keep = torch.maximum(keep, torch.clamp(room, max=self.stack.min_tokens).unsqueeze(1))
        return keep + n_exempt.unsqueeze(1)

    def uniform(
        self, layer: CompressedLayer, seen: int | None = None, like: CompressedLayer | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(base, room, exempt), each (b,): tokens each head keeps under a uniform split of the
        budget, the evictable tokens a full cache would hold, and the exempt ones it holds on top,
        after `seen` slots. `like` lends batch, device and token bytes to a layer the prompt has
        not reached yet."""
        ref = like or layer
        seen = layer.seen if seen is None else seen
        if like is None:  # every layer of a step with the same window has the same split
            if self._uniform is None or self._uniform[0] != seen:
                self._uniform = (seen, {})
            found = self._uniform[1].get(layer.sliding_window)
            if found is None:
                found = self._uniform[1][layer.sliding_window] = self._uniform_of(layer, seen, ref)
            return found
        return self._uniform_of(layer, seen, ref)

    def _uniform_of(
        self, layer: CompressedLayer, seen: int, ref: CompressedLayer
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        room, n_exempt = self.room(layer, seen, ref)
        cost = self.cost(ref)
        budgets = self.budgets_at(seen, ref)
        if self.codecs is not None:
            for b, budget in enumerate(budgets):
                self._check_affordable(int(room[b]), cost, budget)
        if len(set(budgets)) == 1:
            return tokens_to_keep(budgets[0], room, cost), room, n_exempt
        base = torch.cat([tokens_to_keep(budget, room[b : b + 1], cost) for b, budget in enumerate(budgets)])
        return base, room, n_exempt

    def room(self, layer: CompressedLayer, seen: int, ref: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """(room, exempt), both (b,): evictable tokens a full cache holds in `layer` after `seen`
        slots, and the exempt ones on top (`ref` lends batch and device)."""
        n_full = self.cache.seq.real_counts(seen, ref.batch, device=ref.keys[0].device)
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
        rooms = torch.stack([self.room(layer, seen, ref)[0] for layer in self.cache.layers]).cpu()  # (L, b)
        full, heads = ref.token_bytes(explicit_slots=False), ref.n_kv_heads
        least = float(torch.clamp(rooms, max=self.stack.min_tokens).sum(0).max()) * ref.token_bytes() * heads
        if self.budget.nbytes < least:
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
        group, batched = self.token_group, self.batches_only
        fits = [
            r
            for r in (128, 64, 32, 16, 8, 0)
            if plain_window(r, group, batched) <= affordable / 2 and r < quantizer.residual
        ]
        fits = fits or ([0] if quantizer.residual > 0 else [])  # the smallest window, the last thing to try
        fix = f"use {quantizer.name}(residual={fits[0]}) or a larger budget" if fits else "use a larger budget"
        waiting = plain_window(quantizer.residual, group, batched) - quantizer.residual
        raise UserError(
            f"{quantizer.name}'s residual window ({quantizer.residual} tokens"
            + (f", + {waiting} waiting for a full group" if waiting else "")
            + f") is larger than budget {self.budget} at {n_full} tokens ({affordable:.0f} tokens at full "
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
                residual = plain_window(self.stack.quantizer.residual, self.token_group, self.batches_only)
                dropped = sum(c.token_bytes(d) for c in self.demote_codecs) + slot if self.demote_codecs else 0.0
                fixed = sum(c.fixed_bytes(d) for c in (*self.codecs, *(self.demote_codecs or ())))
                self._cost = Cost(full, kept, residual, full + slot, dropped, fixed)
        return self._cost

    @property
    def token_group(self) -> int:
        """Tokens the quantizer encodes together (a group shares metadata); 1 without one."""
        return max((c.token_group for c in self.codecs), default=1) if self.codecs else 1

    @property
    def batches_only(self) -> bool:
        """True when the quantizer's groups only batch calls (`kvstack.cache.window`)."""
        return bool(self.codecs) and all(c.batches_only for c in self.codecs)

    def to_encode(self, plain: int, decoding: bool) -> int:
        """How many of a head's `plain` tokens held in the model's dtype to code now."""
        residual = self.stack.quantizer.residual
        return to_encode(plain, residual, self.token_group, self.batches_only, decoding)

    def n_exempt(self, layer: CompressedLayer, seen: int | None = None) -> torch.Tensor:
        """(b,) exempt real tokens among the first `seen` slots."""
        seen = layer.seen if seen is None else seen
        n = torch.zeros(layer.batch, dtype=torch.long, device=layer.keys[0].device)
        for start, end in self.cache.seq.exempt:
            if min(end, seen) > start:
                n += self.cache.seq.real_counts(min(end, seen), layer.batch, start, device=n.device)
        return n

    def allocation_weights(self) -> torch.Tensor | None:
        """(L, b, h) the allocators' weights: decided after the prompt (whole-prompt allocators)
        or on first use (a priori ones such as pyramid); None while not yet decided."""
        if self.weights is None and not self.stack.whole_prompt:
            self.weights = self.weigh()
        return self.weights

    def reweigh(self) -> None:
        """Ask the allocators for weights now (the whole prompt went in) and forget the old split."""
        self.weights, self._allocation = self.weigh(), None

    def weigh(self) -> torch.Tensor | None:
        """Ask every allocator of the stack for weights over all layers; their product."""
        base, room = self._uniform_all(max(layer.seen for layer in self.cache.layers))
        plan = self.plan = Plan(self.policy, base[..., 0], room[..., 0])
        out = None
        for allocator in self.stack.allocators:
            w = allocator.weights(plan)
            if w is not None:
                out = w.double() if out is None else out * w.double()
        return out

    def _uniform_all(self, seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(base, room), both (L, b, h): the uniform split of every layer after `seen` slots."""
        like = next(layer for layer in self.cache.layers if layer.is_initialized)
        pairs = [self.uniform(layer, seen, like) for layer in self.cache.layers]
        h = self.cache.layers[0].n_kv_heads
        base = torch.stack([p[0] for p in pairs]).unsqueeze(-1).expand(-1, -1, h)
        room = torch.stack([p[1] for p in pairs]).unsqueeze(-1).expand(-1, -1, h)
        return base, room

    def allocation(self, seen: int, weights: torch.Tensor) -> torch.Tensor:
        """(L, b, h) tokens per layer and head after `seen` slots, shared by the weights (memoised
        per step: every layer of a step reads the same allocation)."""
        if self._allocation is None or self._allocation[0] != seen:
            base, room = self._uniform_all(seen)
            least = self.stack.min_tokens
            self._allocation = (seen, distribute(weights.to(base.device), base, room, least))
        return self._allocation[1]
