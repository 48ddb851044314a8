"""`SlabCache`: a decoding cache whose tensors never change shape, for `torch.compile` and CUDA graphs.

A budget says in advance how many tokens each head may hold, so a layer's storage can be
allocated once: keys and values (b, h, capacity, d) and each place's slot (b, h, capacity)
(-1: empty), filled from a prompt a `KVCache` prefilled and compressed. A decoding step writes
each head's new token at that head's length, in place, and the layer attends in one masked call
over its whole slab; no tensor is created, grown or freed by the step, so `torch.compile`
(`fullgraph=True`) traces it once. Between steps, outside any compiled code, the cache's own
policy decides as it does for a `KVCache` (the same checks, the same block eviction), over views
of the slab, and the kept tokens are written back to the front of each head's slab: eviction
frees places, not memory. `nbytes()` reads the slabs: the most the budget lets a head hold
while decoding (plus `ROOM` places), held from the first step, as transformers' StaticCache
holds its maximum length.

A slab holds eviction stacks: scorers that read keys, values or observed queries, with
allocators that give layers their budgets. A stack that codes, merges, folds, joins, retrieves,
plans, scores by attention weights or splits a layer's budget unevenly among its heads is
refused in one line (`check_slab`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from kvstack.cache.heads import PerHead
from kvstack.cache.keep import Keep
from kvstack.cache.layer import SLOT_DTYPE, storage_bytes
from kvstack.cache.slab import ROOM, SlabLayer, SlabView
from kvstack.errors import UserError
from kvstack.methods.base import Stage

if TYPE_CHECKING:
    from kvstack.cache.cache import KVCache
    from kvstack.cache.layer import CompressedLayer
    from kvstack.stack import Stack


def slab_refusal(stack: Stack) -> str | None:
    """Why `stack` cannot decode on a slab, or None when it can."""
    if stack.quantizer is not None:
        return "codes its tokens"
    roles = {
        "merges the tokens it evicts": stack.merger is not None,
        "keeps low-precision copies": stack.demotes,
        "folds evicted tokens into one": stack.compensates,
        "shares tokens across layers": stack.joiner is not None,
        "moves tokens to a slow tier": stack.retriever is not None,
        "plans storage per head": stack.planner is not None,
        # one capacity a head would hold each head at the fullest one's share: up to h times the budget
        "splits a layer's budget unevenly among its heads": any(a.splits for a in stack.allocators),
        "scores by attention weights or a pass over the prompt": bool(stack.needs),
    }
    for why, holds in roles.items():
        if holds:
            return why
    hooked = [
        p.name
        for p in stack.parts
        if type(p).tokens_in is not Stage.tokens_in or type(p).step_done is not Stage.step_done
    ]
    return f"{hooked[0]} watches every decoding step" if hooked else None


def check_slab(stack: Stack) -> None:
    """One-line error unless `stack` only evicts by what a slab holds (see module docstring)."""
    why = slab_refusal(stack)
    if why is not None:
        raise UserError(
            f"{stack.label} {why}, which a slab (fixed-shape storage for compiled decoding) cannot hold: "
            "decode it on its KVCache, or use an eviction stack such as keydiff, snapkv or pyramid(keydiff)"
        )


class SlabCache(Cache):
    """A compressed prompt's cache in fixed-shape storage, decoding under its stack's policy (see
    module docstring). Build it with `SlabCache(cache, new_tokens)` from a prefilled `KVCache`;
    after each forward call `advance(q)`, which lets the policy evict between steps."""

    def __init__(self, cache: KVCache, new_tokens: int) -> None:
        check_slab(cache.stack)
        if not cache.is_initialized:
            raise UserError("a slab starts from a prefilled cache: run the prompt through the KVCache first")
        if any(layer.is_coded or layer.tier is not None or layer.comp_slot is not None for layer in cache.layers):
            raise UserError("this cache holds coded, offloaded or folded tokens, which a slab cannot hold")
        if cache.needs or any(layer.stats for layer in cache.layers):
            raise UserError("this cache records attention statistics (observe=...), which a slab does not extend")
        padding = cache.seq.padding
        if padding is not None and any(layer.is_sliding for layer in cache.layers):
            raise UserError(
                "a padded batch on a model with sliding layers cannot decode on a slab: decode it on its KVCache"
            )
        self.cache = cache
        self.seen = cache.layers[0].seen
        self._pending = False  # an eager forward ran and `advance` has not yet followed it
        self.grown = 0  # slabs re-allocated because a head outgrew its capacity (each one a recompile)
        # a share may peak inside the decode (a byte budget's sliding layers): the most of three points
        points = [self._shares_at(self.seen + n) for n in (0, new_tokens // 2, new_tokens)]
        shares = [max(column) for column in zip(*points, strict=True)]
        slabs = [self._fill(layer, share) for layer, share in zip(cache.layers, shares, strict=True)]
        super().__init__(layers=slabs)
        self.slabs: list[SlabLayer] = slabs
        self.sync()  # the KVCache's layers now view the slabs: the prompt's own tensors are freed

    def _shares_at(self, seen: int) -> list[int]:
        """Per layer, the most tokens a head may hold after `seen` slots under the cache's policy
        (the budget's share then, or the whole context at budget 1.0)."""
        cache, shares = self.cache, []
        for layer in cache.layers:
            if cache.stack.evictor is None or cache.budget.is_full:
                shares.append(seen if layer.sliding_window is None else min(seen, layer.sliding_window - 1))
            else:
                shares.append(int(cache.policy.shares.keep_allowed(layer, seen).max()))
        return shares

    def _fill(self, layer: CompressedLayer, share: int) -> SlabLayer:
        """A slab holding `layer`'s real tokens at the front of each head (padding places dropped),
        with `share` places per head (no fewer than it holds) plus `ROOM`, and a ring of the
        stack's query window."""
        valid = layer.valid_mask(layer.dense_slots())
        if not bool(valid.all()):  # padding holds places the policy never counts: drop them now
            layer.apply(Keep(index=torch.argsort((~valid).to(torch.int8), dim=-1, stable=True), count=valid.sum(-1)))
        b, h = layer.batch, layer.n_kv_heads
        capacity = max(share, *(layer.head_len(i) for i in range(h))) + ROOM
        k0 = layer.keys[0]
        keys = k0.new_zeros(b, h, capacity, k0.shape[-1])
        values = layer.values[0].new_zeros(b, h, capacity, layer.values[0].shape[-1])
        slots = torch.full((b, h, capacity), -1, dtype=SLOT_DTYPE, device=k0.device)
        length = torch.zeros(h, dtype=torch.long, device=k0.device)
        slab = SlabLayer(keys, values, slots, length, [0] * h, layer.sliding_window)
        self._absorb(layer, slab)
        window = self.cache.query_window
        if window > 0 and layer.queries is not None and layer.query_slots is not None:
            held = layer.queries[:, :, -window:]  # the ring: the window's places, the newest last
            slab.queries = held.new_zeros(*held.shape[:2], window, held.shape[-1])
            slab.query_slots = torch.full((window,), -1, dtype=layer.query_slots.dtype, device=held.device)
            slab.queries[:, :, window - held.shape[2] :] = held
            slab.query_slots[window - held.shape[2] :] = layer.query_slots[-window:]
            slab.observed = held.shape[2]
        return slab

    # ---- the transformers Cache API (traced by torch.compile: tensors only, no host state) ----
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        """Write keys/values (b, h, q, d) at each head's length, in place; the view attention reads."""
        slab = self.slabs[layer_idx]
        if layer_idx == 0 and not torch.compiler.is_compiling():  # eager: each forward is followed by `advance`
            if self._pending:
                raise UserError(
                    "a SlabCache evicts between steps: call advance(q) after each forward "
                    "(kvstack.generate.SlabRunner does; model.generate does not)"
                )
            self._pending = True
        b, h, q, d = key_states.shape
        if q > 1 and not torch.compiler.is_compiling():
            raise UserError("a slab decodes one token per sequence a step: run longer inputs on the KVCache")
        slots = (cache_kwargs or {}).get("cache_position")
        if slots is None:
            raise ValueError("a SlabCache needs cache_position (kvstack's loop and model.generate pass it)")
        capacity = slab.capacity
        at = slab.length.view(1, h, 1) + torch.arange(q, device=key_states.device)  # (1, h, q) each head's places
        rows = at + torch.arange(b * h, device=at.device).view(b, h, 1) * capacity  # in (b*h*capacity) rows
        rows = rows.reshape(-1)
        # index_copy_ into the flattened slab: touches q rows a head (a scatter_ walks the whole slab)
        slab.keys.view(b * h * capacity, d).index_copy_(0, rows, key_states.reshape(-1, d).to(slab.keys.dtype))
        dv = value_states.shape[-1]
        slab.values.view(b * h * capacity, dv).index_copy_(0, rows, value_states.reshape(-1, dv).to(slab.values.dtype))
        new_slots = slots.to(SLOT_DTYPE).view(1, 1, q).expand(b, h, q).reshape(-1)
        slab.slots.view(-1).index_copy_(0, rows, new_slots)
        slab.length.add_(q)
        view = SlabView(slab, slots)
        return view, view

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:
        # the slab's places, not the tokens seen: a host count here would make every step trace anew
        return self.slabs[layer_idx].capacity, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.slabs[layer_idx].capacity

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return True

    # ---- between steps: the policy decides over views of the slab ---------------------------
    def advance(self, q: int = 1) -> None:
        """After a forward of `q` new tokens: account for them on the host, then let the policy
        check each layer and evict as it would on the `KVCache` (only where it may be over)."""
        cache, self.seen, self._pending = self.cache, self.seen + q, False
        padding = cache.seq.padding
        if padding is not None and padding.shape[1] < self.seen:  # decoded tokens are real
            cache.seq.padding = torch.cat(
                [padding, padding.new_ones(padding.shape[0], self.seen - padding.shape[1])], 1
            )
        evicts = cache.stack.evictor is not None and not cache.budget.is_full
        for layer, slab in zip(cache.layers, self.slabs, strict=True):
            slab.used = [n + q for n in slab.used]
            layer.seen = self.seen
            if slab.queries is not None and slab.query_slots is not None:  # the ring's filled places, newest last
                slab.observed = min(slab.observed + q, slab.queries.shape[2])
                layer.queries = slab.queries[:, :, -slab.observed :]
                layer.query_slots = slab.query_slots[-slab.observed :]
            if not layer.is_sliding and (not evicts or self.seen <= layer.next_check):
                continue  # no head can be over its share yet (`Policy._maintain` would return at once)
            self._expose(layer, slab)
            before = layer.keys
            cache.policy.maintain(layer, decoding=True)
            if layer.keys is not before:  # the policy kept fewer tokens: back to the front of the slab
                self._absorb(layer, slab)
        for slab in self.slabs:
            if max(slab.used) + 1 > slab.capacity:  # the next step would not fit
                self._grow(slab)

    def sync(self) -> None:
        """Point every layer of the KVCache at what its slab holds (for `stats` and `counts`)."""
        for layer, slab in zip(self.cache.layers, self.slabs, strict=True):
            self._expose(layer, slab)

    def _expose(self, layer: CompressedLayer, slab: SlabLayer) -> None:
        """Point `layer` at its slab: per head the views of its used places (b, n_h, d) and slots."""
        n = slab.used
        if len(set(n)) == 1:  # heads alike: one view of the slab (a PerHead of equal heads would stack a copy)
            layer.keys = PerHead(stacked=slab.keys[:, :, : n[0]])
            layer.values = PerHead(stacked=slab.values[:, :, : n[0]])
        else:
            layer.keys = PerHead([slab.keys[:, h, : n[h]] for h in range(len(n))])
            layer.values = PerHead([slab.values[:, h, : n[h]] for h in range(len(n))])
        layer.slots = [slab.slots[:, h, : n[h]] for h in range(len(n))]

    def _absorb(self, layer: CompressedLayer, slab: SlabLayer) -> None:
        """Write `layer`'s tokens per head to the front of its slab, emptying the places after them."""
        for h in range(layer.n_kv_heads):
            keys = layer.keys[h]
            n = keys.shape[1]
            if n > slab.capacity:
                raise RuntimeError(
                    f"head {h} of layer {layer.layer_idx} holds {n} tokens, over its slab of {slab.capacity}"
                )
            slab.keys[:, h, :n].copy_(keys)
            slab.values[:, h, :n].copy_(layer.values[h])
            slots = layer.head_slots(h).expand(layer.batch, -1)
            slab.slots[:, h, :n].copy_(torch.where(layer.valid_mask(slots), slots, -1))  # padding: empty
            slab.slots[:, h, n:] = -1
            slab.used[h] = n
        slab.length.copy_(torch.tensor(slab.used, device=slab.length.device))

    def _grow(self, slab: SlabLayer) -> None:
        """Re-allocate `slab` a quarter larger (a compiled step then traces again): only when a
        head holds more than the shares its capacity was sized by (tested: never on the stacks and
        budgets of tests/test_slab.py)."""
        self.grown += 1
        extra = max(16, slab.capacity // 4)
        slab.keys = F.pad(slab.keys, (0, 0, 0, extra))
        slab.values = F.pad(slab.values, (0, 0, 0, extra))
        slab.slots = F.pad(slab.slots, (0, extra), value=-1)

    # ---- measurement ------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the slabs hold, read off their tensors (empty places included: they are allocated)."""
        return storage_bytes([t for slab in self.slabs for t in slab.tensors()])

    def counts(self) -> list[list[int]]:
        """Per layer, the places each head uses (its tokens, empty places of shorter rows included)."""
        return [list(slab.used) for slab in self.slabs]
