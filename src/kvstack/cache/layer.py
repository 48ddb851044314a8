"""One layer's KV storage: per KV head its own kept tokens, ragged across heads, no masking.

Each head h holds its tokens in parts: older tokens encoded by a quantizer (`Coded`, packed
codes), then the newest in the model's dtype (keys, values (b, r_h, d)); and the logical slot
of each token (b, t_h) in that storage order. Slots stay implicit (a contiguous range, zero
bytes) until the first eviction. A slot of -1 marks an empty place, used only when sequences
of one batch keep different counts. Methods see every head as one dense view sorted by slot.

A merging method makes one entry stand for several tokens: its count is kept as a per-token
log-count (`WEIGHT`, float32 (b, t_h)) that attention adds to the entry's logit, so the merged
tokens keep their share of attention mass. It is part of the KV bytes, created on first merge.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from kvstack.cache.coded import Coded, alike, compact, decode_heads
from kvstack.cache.encoded import Codec, Encoded, Turned, Where, gather_rows
from kvstack.cache.heads import PerHead
from kvstack.cache.keep import Keep
from kvstack.cache.levels import LevelCodes
from kvstack.cache.packed import Packed, packed
from kvstack.cache.sequence import SequenceState
from kvstack.cache.tier import Tier

SLOT_DTYPE = torch.int32
WEIGHT = "log_count"  # per-token statistic: log of how many tokens a merged entry stands for
Part = torch.Tensor | Turned | Packed | LevelCodes  # tokens as attention reads them (on a rotated basis; as codes)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: what they really keep alive."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class CompressedLayer:
    """KV storage of one attention layer (see module docstring)."""

    def __init__(
        self,
        layer_idx: int,
        n_layers: int,
        n_kv_heads: int,
        groups: int,
        scaling: float,
        sliding_window: int | None,
        seq: SequenceState,
    ) -> None:
        self.layer_idx, self.n_layers = layer_idx, n_layers
        self.n_kv_heads, self.groups, self.scaling = n_kv_heads, groups, scaling
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.seq = seq
        self._keys = PerHead()  # per head (b, r_h, d): the tokens held in the model's dtype
        self._values = PerHead()
        self.coded: list[list[Coded]] = [[] for _ in range(n_kv_heads)]  # per head, older tokens encoded
        self.slots: list[torch.Tensor] | None = None  # per head (b, t_h) SLOT_DTYPE, None = implicit
        self.start = 0  # first slot while slots are implicit
        self.seen = 0  # logical slots appended so far
        self.queries: torch.Tensor | None = None  # (b, h*g, w, d)
        self.query_slots: torch.Tensor | None = None  # (w,)
        self.stats: dict[str, list[torch.Tensor]] = {}  # name -> per head (b, t_h) float32
        self.inv_freq: torch.Tensor | None = None  # (d/2,) RoPE inverse frequencies, when known
        # a compensation token per head (RazorAttention): its slot (b, h), -1 = none, and how many
        # evicted tokens it averages (b, h); None until a stack folds evicted tokens
        self.comp_slot: torch.Tensor | None = None
        self.comp_count: torch.Tensor | None = None
        self.next_check = -1  # while decoding, no head exceeds its share up to this slot (KVCache._maintain)
        self.tier: Tier | None = None  # tokens a retrieval method moved out, and their resident index

    # ---- reading -------------------------------------------------------------------------
    @property
    def keys(self) -> PerHead:
        """Per head (b, r_h, d) the keys held in the model's dtype (`PerHead`: stacked while alike)."""
        return self._keys

    @keys.setter
    def keys(self, heads: Sequence[torch.Tensor]) -> None:
        self._keys = PerHead.of(heads)

    @property
    def values(self) -> PerHead:
        """Per head (b, r_h, d) the values held in the model's dtype."""
        return self._values

    @values.setter
    def values(self, heads: Sequence[torch.Tensor]) -> None:
        self._values = PerHead.of(heads)

    @property
    def is_initialized(self) -> bool:
        return bool(self.keys)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def head_len(self, h: int) -> int:
        return sum(c.n for c in self.coded[h]) + self.keys[h].shape[1]

    def head_slots(self, h: int) -> torch.Tensor:
        """(b, t_h) long slots of head h in storage order (or (t_h,) while implicit)."""
        if self.slots is None:
            return torch.arange(self.start, self.seen, device=self.keys[h].device)
        return self.slots[h].long()

    def head_keys(self, h: int) -> torch.Tensor:
        """(b, t_h, d) head h's keys in storage order, encoded parts decoded (a transient copy)."""
        if not self.coded[h]:
            return self.keys[h]
        return torch.cat([*(c.keys.decode() for c in self.coded[h]), self.keys[h]], dim=1)

    def head_values(self, h: int) -> torch.Tensor:
        """(b, t_h, d) head h's values in storage order, encoded parts decoded."""
        if not self.coded[h]:
            return self.values[h]
        return torch.cat([*(c.values.decode() for c in self.coded[h]), self.values[h]], dim=1)

    def head_parts(self, h: int) -> tuple[list[Part], list[Part]]:
        """Head h's keys and values as parts along its tokens in storage order, each (b, t_i, d):
        the encoded parts as codes (`Packed`, read by a kernel) or decoded straight to float32
        (`Turned` when kept on a rotated basis), then the tokens held in the model's dtype; never
        joined into one tensor."""

        def read(enc: Encoded) -> Part:
            return packed([enc], one_head=True) or enc.read(torch.float32)

        keys = [*(read(c.keys) for c in self.coded[h]), self.keys[h]]
        return keys, [*(read(c.values) for c in self.coded[h]), self.values[h]]

    def layer_kv(self) -> tuple[list[Part], list[Part]] | None:
        """(keys, values) as parts along the tokens in storage order, each (b, h, t_i, d): every
        head's encoded parts as codes in one `Packed` part, or decoded to float32 in one call per
        part (`Turned` when kept on a rotated basis), then the tokens held in the model's dtype;
        when the heads are alike (plain tokens stacked, the same parts with the same uniform codecs
        and shapes, nothing merged). Else None, and attention goes head by head."""
        keys, values = self.keys.stacked, self.values.stacked
        if keys is None or values is None or WEIGHT in self.stats:
            return None
        if not any(self.coded):
            return [keys], [values]
        first = self.coded[0]
        if any(len(parts) != len(first) for parts in self.coded):
            return None
        pairs = [(p, q) for parts in self.coded for p, q in zip(parts, first, strict=True)]
        if not all(alike(p.keys, q.keys) and alike(p.values, q.values) and p.demoted == q.demoted for p, q in pairs):
            return None

        def read(heads: list[Encoded]) -> Part:  # attention reads float32: decode straight to it
            return packed(heads) or decode_heads(heads, torch.float32)

        heads = range(self.n_kv_heads)
        coded_keys = [read([self.coded[h][i].keys for h in heads]) for i in range(len(first))]
        coded_values = [read([self.coded[h][i].values for h in heads]) for i in range(len(first))]
        return [*coded_keys, keys], [*coded_values, values]

    def head_bias(self, h: int) -> torch.Tensor | None:
        """(b, t_h) float32 log-count added to head h's attention logits (storage order), or None
        when nothing was merged."""
        weights = self.stats.get(WEIGHT)
        return weights[h] if weights is not None else None

    @property
    def is_coded(self) -> bool:
        """True once some tokens are held encoded."""
        return any(self.coded)

    def storage_order(self, h: int) -> torch.Tensor | None:
        """(b, t_h) the storage positions of head h sorted by slot (empty places last), or None
        when storage is already in slot order (it is unless tokens of one head are held at
        several precisions: MiKV's demoted ones, QAQ's per-token bit widths, MiniCache's retained ones)."""
        if not self.coded[h]:
            return None
        slots = self.head_slots(h).expand(self.batch, -1)
        key = torch.where(slots < 0, torch.iinfo(torch.long).max, slots)
        if bool((key[:, 1:] >= key[:, :-1]).all()):
            return None
        return torch.argsort(key, dim=1, stable=True)

    def dense(self, per_head: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Stack per-head tensors (b, t_h, ...) in storage order into (b, h, t_max, ...) sorted by
        slot, padding with `fill`."""
        orders = [self.storage_order(h) for h in range(len(per_head))]
        if any(o is not None for o in orders):
            per_head = [
                x if o is None else gather_rows(x.expand(o.shape[0], *x.shape[1:]), o)
                for x, o in zip(per_head, orders, strict=True)
            ]
        t_max = max(x.shape[1] for x in per_head)
        if all(x.shape[1] == t_max for x in per_head):
            return torch.stack(per_head, dim=1)
        out = per_head[0].new_full((per_head[0].shape[0], len(per_head), t_max, *per_head[0].shape[2:]), fill)
        for h, x in enumerate(per_head):
            out[:, h, : x.shape[1]] = x
        return out

    def dense_slots(self) -> torch.Tensor:
        """(b, h, t_max) long slots, -1 where a head holds fewer tokens."""
        b = self.batch
        heads = [self.head_slots(h).expand(b, -1) for h in range(self.n_kv_heads)]
        return self.dense(heads, fill=-1).long()

    def valid_mask(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool like slots (b, ..., t): a real token sits there (not empty, not padding)."""
        ok = slots >= 0
        pad = self.seq.padding
        if pad is None:
            return ok
        b = slots.shape[0]
        flat = slots.clamp(min=0).reshape(b, -1)
        return ok & torch.gather(pad, 1, flat).reshape(slots.shape)

    def counts(self, exclude_demoted: bool = False) -> torch.Tensor:
        """(b, h) real tokens held per head (not counting demoted ones if asked); read per head in
        storage order (no dense view: the policy asks at every decoding step)."""
        b, device = self.batch, self.keys[0].device
        if self.slots is None and self.seq.padding is None:  # every slot of the contiguous range is real
            return torch.tensor([[self.head_len(h) for h in range(self.n_kv_heads)]] * b, device=device)
        per_head = []
        for h in range(self.n_kv_heads):
            valid = self.valid_mask(self.head_slots(h).expand(b, -1))
            if exclude_demoted:
                valid = valid & ~self.head_demoted(h)
            per_head.append(valid.sum(-1))
        return torch.stack(per_head, dim=1)

    def head_demoted(self, h: int) -> torch.Tensor:
        """(b, t_h) True, in storage order, where head h holds a token a selection demoted (MiKV)."""
        parts = [torch.full((self.batch, c.n), c.demoted, dtype=torch.bool) for c in self.coded[h]]
        plain = torch.zeros(self.batch, self.keys[h].shape[1], dtype=torch.bool)
        return torch.cat([*parts, plain], 1).to(self.keys[0].device)

    def dense_demoted(self) -> torch.Tensor:
        """(b, h, t) True where the dense view holds a token a selection demoted (MiKV)."""
        return self.dense([self.head_demoted(h) for h in range(self.n_kv_heads)], fill=False).bool()

    def nbytes(self) -> int:
        """Bytes of storage this layer keeps alive for attention: keys, values, slots (and the
        compensation tokens' bookkeeping)."""
        return storage_bytes(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps alive for attention (what `nbytes` counts); a cache that
        shares storage across layers (MiniCache, xKV) counts it once over all layers' lists."""
        comp = [t for t in (self.comp_slot, self.comp_count) if t is not None]
        coded = [t for parts in self.coded for c in parts for t in c.tensors()]
        weight = self.stats.get(WEIGHT, [])
        tier = self.tier.tensors() if self.tier is not None else []
        return [*self.keys, *self.values, *coded, *(self.slots or []), *comp, *weight, *tier]

    def head_nbytes(self, h: int) -> int:
        """Bytes of storage head h keeps alive (tables shared by heads, such as codebooks, included)."""
        coded = [t for c in self.coded[h] for t in c.tensors()]
        weight = [self.stats[WEIGHT][h]] if WEIGHT in self.stats else []
        plain = self.keys.nbytes(h) + self.values.nbytes(h)  # a stacked tensor is shared: count head h's part
        return plain + storage_bytes([*coded, *([self.slots[h]] if self.slots else []), *weight])

    def aux_nbytes(self) -> int:
        """Bytes of what methods observe (queries, attention statistics), not part of the KV."""
        queries = [self.queries] if self.queries is not None else []
        stats = [t for name, per_head in self.stats.items() if name != WEIGHT for t in per_head]
        return storage_bytes([*queries, *stats])

    def full_nbytes(self) -> int:
        """Bytes a plain full cache would hold for this layer's tokens (its window, when sliding)."""
        held = min(self.seen, self.sliding_window - 1) if self.sliding_window else self.seen
        return self.batch * self.n_kv_heads * held * self.token_bytes(explicit_slots=False)

    def head_stats(self) -> list[dict[str, Any]]:
        """Per head: tokens held per sequence (real ones), places and bytes held."""
        counts = self.counts()
        return [
            {
                "layer": self.layer_idx,
                "head": h,
                "sliding": self.is_sliding,
                "tokens": counts[:, h].tolist(),
                "slots": self.head_len(h),
                "bytes": self.head_nbytes(h),
            }
            for h in range(self.n_kv_heads)
        ]

    def token_bytes(self, explicit_slots: bool = True) -> int:
        """Bytes one token costs in one head: key, value and (once compressed) its slot."""
        k = self.keys[0]
        per = 2 * k.shape[-1] * k.element_size()
        return per + (torch.tensor([], dtype=SLOT_DTYPE).element_size() if explicit_slots else 0)

    # ---- writing -------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, first: int | None = None) -> None:
        """Append new tokens: keys/values (b, h, q, d) at logical slots (q,), the consecutive slots
        first..first+q-1 (`first` given by the cache, so a decoding step never reads the device)."""
        q = keys.shape[2]
        first = int(slots[0]) if first is None else first
        if not self.keys:
            self.keys = PerHead(stacked=keys.contiguous())
            self.values = PerHead(stacked=values.contiguous())
            self.start = first
        else:
            self.keys, self.values = self.keys.append(keys), self.values.append(values)
        if self.slots is not None:
            new = slots.to(SLOT_DTYPE).expand(keys.shape[0], q)
            self.slots = [torch.cat([s, new], dim=1) for s in self.slots]
        for name, per_head in self.stats.items():
            self.stats[name] = [torch.cat([x, x.new_zeros(x.shape[0], q)], dim=1) for x in per_head]
        self.seen = first + q

    def encode_oldest(
        self, h: int, count: int, quantizer: Any, codecs: tuple[Codec, Codec], queries: torch.Tensor | None
    ) -> None:
        """Move head h's `count` oldest tokens held in the model's dtype into encoded parts, each
        joined to the latest part with the same codecs. queries: (b, g, w, d) the head's observed
        queries, for quantizers that use them (SQuat, QAQ). A quantizer may split the tokens into
        several precisions: their slots and statistics move with them."""
        if count <= 0:
            return
        keys, values = self.keys[h][:, :count], self.values[h][:, :count]
        where = Where(self.layer_idx, h, "key", lambda: queries, lambda: self._positions(h, count), self.inv_freq)
        encoded = quantizer.encode(keys, values, where, codecs, self)
        targets = [self._part_for(h, enc_k.codec, enc_v.codec) for enc_k, enc_v, _ in encoded]
        if len(encoded) > 1 or targets[0] not in (None, len(self.coded[h]) - 1):  # tokens change place in storage
            self._regroup(h, encoded, targets)
        for enc_k, enc_v, _ in encoded:
            part, at = Coded(enc_k, enc_v), self._part_for(h, enc_k.codec, enc_v.codec)
            if at is None:
                self.coded[h].append(part)
            else:
                self.coded[h][at] = self.coded[h][at].cat(part)
        self.keys = self.keys.with_head(h, self.keys[h][:, count:].clone())
        self.values = self.values.with_head(h, self.values[h][:, count:].clone())

    def encode_heads(
        self, jobs: list[tuple[int, int, tuple[Codec, Codec]]], quantizer: Any, queries: torch.Tensor | None
    ) -> None:
        """`encode_oldest` for several heads, jobs (head, count, codecs): heads moving as many
        tokens into the last part of the same codecs (or a first one), by a quantizer and codecs
        that code each row on its own (`rows_alike`), are encoded in one call, their rows laid
        along the batch (one encode a layer, not one a head); the others one by one.
        queries: (b, h*g, w, d) the layer's observed queries, or None."""
        alike_: dict[tuple[int, int], list[int]] = {}  # (count, codecs) -> heads
        for h, count, pair in jobs:
            last = len(self.coded[h]) - 1
            joins = self._part_for(h, *pair) in (None, last)
            if joins and all(c.rows_alike for c in pair) and quantizer.rows_alike:
                alike_.setdefault((count, id(pair)), []).append(h)
                continue
            g = self.groups
            mine = queries[:, h * g : (h + 1) * g] if queries is not None else None
            self.encode_oldest(h, count, quantizer, pair, mine)
        codecs = {id(pair): pair for _, _, pair in jobs}
        for (count, key), heads in alike_.items():
            self._encode_stacked(heads, count, codecs[key])

    def _encode_stacked(self, heads: list[int], count: int, codecs: tuple[Codec, Codec]) -> None:
        """Heads' `count` oldest plain tokens encoded in one call per codec, (len(heads) * b, count, d)."""
        b = self.batch
        where = Where(self.layer_idx, heads[0], "key", inv_freq=self.inv_freq)
        keys = torch.cat([self.keys[h][:, :count] for h in heads])
        values = torch.cat([self.values[h][:, :count] for h in heads])
        value_where = Where(self.layer_idx, heads[0], "value", inv_freq=self.inv_freq)
        enc_k, enc_v = codecs[0].encode(keys, where), codecs[1].encode(values, value_where)
        for i, h in enumerate(heads):
            part = Coded(enc_k.batch_rows(i * b, (i + 1) * b, h), enc_v.batch_rows(i * b, (i + 1) * b, h))
            at = self._part_for(h, *codecs)
            if at is None:
                self.coded[h].append(part)
            else:
                self.coded[h][at] = self.coded[h][at].cat(part)
        if len(heads) == self.n_kv_heads and self.keys.stacked is not None and self.values.stacked is not None:
            self.keys, self.values = self.keys.drop_oldest(count), self.values.drop_oldest(count)
            return
        moved = set(heads)
        self.keys = PerHead([x[:, count:].clone() if h in moved else x for h, x in enumerate(self.keys)])
        self.values = PerHead([x[:, count:].clone() if h in moved else x for h, x in enumerate(self.values)])

    def _positions(self, h: int, count: int) -> torch.Tensor:
        """(b, count) positions in their sequences of head h's `count` oldest tokens held in the
        model's dtype (padding not counted)."""
        first = self.head_len(h) - self.keys[h].shape[1]
        slots = self.head_slots(h).expand(self.batch, -1)[:, first : first + count].clamp(min=0)
        index = self.seq.token_index()
        return slots if index is None else torch.gather(index, 1, slots)

    def _part_for(self, h: int, key_codec: Codec, value_codec: Codec) -> int | None:
        """Index of head h's part (not demoted) with these codecs, or None."""
        same = [
            i
            for i, p in enumerate(self.coded[h])
            if not p.demoted and p.keys.codec.same(key_codec) and p.values.codec.same(value_codec)
        ]
        return same[-1] if same else None

    def _regroup(self, h: int, encoded: list[tuple[Encoded, Encoded, torch.Tensor]], targets: list[int | None]) -> None:
        """Reorder head h's slots and statistics for tokens leaving the model's dtype into parts
        that are not simply appended: `encoded` lists (keys, values, positions (n_i,) among the
        tokens leaving), `targets` the existing part each joins (None: a new part at the end)."""
        b = self.batch
        slots = self.head_slots(h).expand(b, -1).to(SLOT_DTYPE)
        if self.slots is None:
            self.slots = [self.head_slots(i).expand(b, -1).to(SLOT_DTYPE).clone() for i in range(self.n_kv_heads)]
        device = slots.device
        start = sum(c.n for c in self.coded[h])  # where the tokens leaving sit now
        joining = [
            [start + pos.to(device) for (_, _, pos), t in zip(encoded, targets, strict=True) if t == i]
            for i in range(len(self.coded[h]))
        ]
        order, lo = [], 0
        for part, extra in zip(self.coded[h], joining, strict=True):
            order += [torch.arange(lo, lo + part.n, device=device), *extra]
            lo += part.n
        order += [start + pos.to(device) for (_, _, pos), t in zip(encoded, targets, strict=True) if t is None]
        leaving = sum(pos.numel() for _, _, pos in encoded)
        order.append(torch.arange(start + leaving, slots.shape[1], device=device))
        index = torch.cat(order)
        self.slots[h] = slots[:, index]
        for per_head in self.stats.values():
            per_head[h] = per_head[h][:, index]

    def observe_queries(self, queries: torch.Tensor, slots: torch.Tensor, window: int) -> None:
        """Keep the last `window` queries (b, h*g, q, d) and their slots (q,)."""
        if window <= 0:
            return
        if self.queries is None or queries.shape[2] >= window:
            self.queries, self.query_slots = queries[:, :, -window:].clone(), slots[-window:].clone()
        else:
            self.queries = torch.cat([self.queries, queries], dim=2)[:, :, -window:]
            assert self.query_slots is not None
            self.query_slots = torch.cat([self.query_slots, slots])[-window:]

    def add_stat(self, name: str, h: int, value: torch.Tensor, accumulate: bool | str) -> None:
        """Record a per-token statistic (b, t_h) for head h: summed (True), replaced (False) or "max"."""
        per_head = self.stats.setdefault(
            name,
            [self.keys[0].new_zeros(self.batch, self.head_len(i), dtype=torch.float32) for i in range(self.n_kv_heads)],
        )
        if accumulate == "max":
            per_head[h] = torch.maximum(per_head[h], value)
        else:
            per_head[h] = per_head[h] + value if accumulate else value

    def apply(self, keep: Keep, demote: tuple[Codec, Codec] | None = None) -> None:
        """Execute a decision: gather each head's kept tokens into new, smaller tensors.

        With `demote` (key and value codecs), tokens the decision leaves out are encoded at that
        low precision instead of freed, and tokens demoted before all stay (MiKV).
        """
        if not self.is_coded and demote is None:
            self._apply_plain(keep)
            return
        heads = []
        for h in range(self.n_kv_heads):
            k_h = int(keep.count[:, h].max().item())
            index = keep.index[:, h, :k_h]
            real = torch.arange(k_h, device=index.device) < keep.count[:, h : h + 1]
            order = self.storage_order(h)
            if order is not None:  # the decision indexes the slot-sorted view
                index = torch.gather(order, 1, index)
            heads.append(self._keep_in_head(h, index, real, demote))
        self.keys = [k for k, _, _, _, _ in heads]
        self.values = [v for _, v, _, _, _ in heads]
        self.coded = [c for _, _, c, _, _ in heads]
        self.slots = [s for _, _, _, s, _ in heads]
        self.stats = {name: [st[name] for _, _, _, _, st in heads] for name in self.stats}

    def _keep_in_head(
        self, h: int, index: torch.Tensor, real: torch.Tensor, demote: tuple[Codec, Codec] | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[Coded], torch.Tensor, dict[str, torch.Tensor]]:
        """Head h after keeping storage positions `index` (b, k) where `real`: (keys, values,
        encoded parts, slots, statistics). Storage order afterwards: the kept encoded parts, the
        demoted part, the kept tokens in the model's dtype."""
        slots = self.head_slots(h).expand(self.batch, -1)
        t = slots.shape[1]
        kept = torch.zeros(self.batch, t + 1, dtype=torch.bool, device=slots.device)
        kept = kept.scatter(1, torch.where(real, index, t), True)[:, :t]
        positions = torch.arange(t, device=slots.device).expand(self.batch, -1)
        pieces: list[tuple[Coded | None, torch.Tensor, torch.Tensor]] = []  # (part, storage positions, real)
        low: list[tuple[Coded, torch.Tensor, torch.Tensor]] = []
        was_low = torch.zeros_like(kept)
        lo = 0
        for part in self.coded[h]:
            hi = lo + part.n
            if part.demoted and demote is not None:  # stays whole
                low.append((part, positions[:, lo:hi], torch.ones_like(kept[:, lo:hi])))
                was_low[:, lo:hi] = True
            elif bool(kept[:, lo:hi].all()):  # untouched: no gather (a grouped code is not encoded again)
                pieces.append((part, positions[:, lo:hi], torch.ones_like(kept[:, lo:hi])))
            else:
                pick, ok = compact(positions[:, lo:hi], kept[:, lo:hi])
                if pick.shape[1]:
                    pieces.append((part.take((pick - lo).clamp(min=0)), pick, ok))
            lo = hi
        if demote is not None:  # what the decision left out, at low precision
            pick, ok = compact(positions, self.valid_mask(slots) & ~kept & ~was_low)
            if pick.shape[1]:
                keys = demote[0].encode(gather_rows(self.head_keys(h), pick), Where(self.layer_idx, h, "key"))
                values = demote[1].encode(gather_rows(self.head_values(h), pick), Where(self.layer_idx, h, "value"))
                low.append((Coded(keys, values, demoted=True), pick, ok))
        if low:
            merged = low[0][0]
            for part, _, _ in low[1:]:
                merged = merged.cat(part)
            picks, oks = torch.cat([p for _, p, _ in low], 1), torch.cat([o for _, _, o in low], 1)
            oks = oks & (torch.gather(slots, 1, picks) >= 0)
            if not bool(oks.all()):  # empty places (rows of a batch keeping fewer) are dropped, not carried
                column, ok = compact(torch.arange(picks.shape[1], device=picks.device).expand_as(picks), oks)
                merged, picks = merged.take(column), torch.gather(picks, 1, column)
                oks = ok
            pieces.append((merged, picks, oks))
        pick, ok = compact(positions[:, lo:], kept[:, lo:])  # the tokens in the model's dtype
        pieces.append((None, pick, ok))
        at = (pick - lo).clamp(min=0)
        picks = torch.cat([p for _, p, _ in pieces], 1)
        oks = torch.cat([o for _, _, o in pieces], 1)
        new_slots = torch.where(oks, torch.gather(slots, 1, picks), torch.full_like(picks, -1)).to(SLOT_DTYPE)
        stats = {name: torch.gather(per_head[h], 1, picks) for name, per_head in self.stats.items()}
        coded = [part for part, _, _ in pieces if part is not None]
        return gather_rows(self.keys[h], at), gather_rows(self.values[h], at), coded, new_slots, stats

    def rewrite(
        self, changed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_count: torch.Tensor | None
    ) -> None:
        """Replace the dense view's entries where `changed` (b, h, t) with keys, values (b, h, t, d)
        and, unless None, log-counts (b, h, t): a merge executed. Changed entries must be held in
        the model's dtype (encoded ones are never rewritten)."""
        if log_count is not None and WEIGHT not in self.stats:
            self.stats[WEIGHT] = [
                self.keys[0].new_zeros(self.batch, self.head_len(i), dtype=torch.float32)
                for i in range(self.n_kv_heads)
            ]
        for h in range(self.n_kv_heads):
            t_h, plain = self.head_len(h), self.keys[h].shape[1]
            order = self.storage_order(h)
            dense_at = (  # (b, t_h) the dense position of each storage position
                torch.arange(t_h, device=changed.device).expand(self.batch, -1)
                if order is None
                else torch.argsort(order, dim=1)
            )
            hit = torch.gather(changed[:, h], 1, dense_at)  # (b, t_h) in storage order
            if bool(hit[:, : t_h - plain].any()):
                raise ValueError("a merge may only rewrite tokens held in the model's dtype")
            if not bool(hit.any()):
                continue
            at = dense_at[:, t_h - plain :]
            write = hit[:, t_h - plain :, None]
            new_keys = torch.where(write, gather_rows(keys[:, h], at).to(self.keys[h].dtype), self.keys[h])
            new_values = torch.where(write, gather_rows(values[:, h], at).to(self.values[h].dtype), self.values[h])
            self.keys, self.values = self.keys.with_head(h, new_keys), self.values.with_head(h, new_values)
            if log_count is not None:
                new = torch.gather(log_count[:, h].float(), 1, dense_at)
                self.stats[WEIGHT][h] = torch.where(hit, new, self.stats[WEIGHT][h])

    def _apply_plain(self, keep: Keep) -> None:
        """`apply` for a layer holding every token in the model's dtype."""
        slots = self.dense_slots()
        widths = keep.count.amax(0)  # (h,) tokens each head keeps in its fullest row
        k = int(widths[0])
        if self.keys.stacked is not None and bool((widths == k).all()):  # every head alike: one gather each
            index = keep.index[..., :k]  # (b, h, k)
            real = torch.arange(k, device=index.device) < keep.count.unsqueeze(-1)
            kept_slots = torch.where(real, torch.gather(slots, 2, index), -1).to(SLOT_DTYPE)
            self.keys, self.values = self.keys.take(index), self.values.take(index)
            self.slots = [s.clone() for s in kept_slots.unbind(1)]  # a storage per head, as appends make
            self.stats = {n: [x.gather(1, index[:, h]) for h, x in enumerate(ph)] for n, ph in self.stats.items()}
            return
        new_keys, new_values, new_slots = [], [], []
        new_stats: dict[str, list[torch.Tensor]] = {name: [] for name in self.stats}
        for h in range(self.n_kv_heads):
            k_h = int(keep.count[:, h].max().item())
            idx = keep.index[:, h, :k_h]  # (b, k_h)
            real = torch.arange(k_h, device=idx.device) < keep.count[:, h : h + 1]
            gather_d = idx.unsqueeze(-1).expand(-1, -1, self.keys[h].shape[-1])
            new_keys.append(torch.gather(self.keys[h], 1, gather_d))
            new_values.append(torch.gather(self.values[h], 1, gather_d))
            s = torch.gather(slots[:, h], 1, idx)
            new_slots.append(torch.where(real, s, torch.full_like(s, -1)).to(SLOT_DTYPE))
            for name, per_head in self.stats.items():
                new_stats[name].append(torch.gather(per_head[h], 1, idx))
        self.keys, self.values, self.slots, self.stats = new_keys, new_values, new_slots, new_stats

    def trim_window(self) -> None:
        """Sliding layers: drop tokens no future query can see (older than window - 1 real tokens)."""
        if self.sliding_window is None or not self.keys:
            return
        keep_last = self.sliding_window - 1
        if self.seq.padding is None and self.slots is None and not self.is_coded:
            drop = self.seen - keep_last - self.start
            if drop > 0:  # copy, so the dropped tokens' storage is really freed
                self.keys, self.values = self.keys.drop_oldest(drop), self.values.drop_oldest(drop)
                self.stats = {n: [x[:, drop:].clone() for x in ph] for n, ph in self.stats.items()}
                self.start += drop
            return
        slots = self.dense_slots()
        valid = self.valid_mask(slots)
        if self.seq.padding is None:
            inside = valid & (slots >= self.seen - keep_last)
        else:
            index = self.seq.padding.long().cumsum(-1)  # (b, slots) real tokens up to each slot
            b, h, t = slots.shape
            k_index = torch.gather(index, 1, slots.clamp(min=0).reshape(b, h * t)).reshape(b, h, t)
            inside = valid & (k_index > index[:, -1:, None] - keep_last)
        if bool(inside.eq(valid).all()):
            return
        index_order = torch.argsort((~inside).to(torch.int8), dim=-1, stable=True)
        self.apply(Keep(index=index_order, count=inside.sum(-1)))

    def copy(self, seq: SequenceState, needs: frozenset[str], query_window: int) -> CompressedLayer:
        """A copy that evolves on its own, keeping only the statistics and queries `needs` and
        `query_window` ask for; tensors are shared until either side replaces them."""
        new = copy.copy(self)
        new.seq, new.next_check = seq, -1
        new.keys, new.values = self.keys, self.values  # never written in place: shared until replaced
        new.coded = [list(parts) for parts in self.coded]
        new.slots = list(self.slots) if self.slots is not None else None
        new.tier = self.tier.copy() if self.tier is not None else None
        new.stats = {name: list(per_head) for name, per_head in self.stats.items() if name in needs | {WEIGHT}}
        if query_window <= 0 or self.queries is None:
            new.queries, new.query_slots = None, None
        else:
            assert self.query_slots is not None
            new.queries, new.query_slots = self.queries[:, :, -query_window:], self.query_slots[-query_window:]
        return new

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in `index` (beam search, finished sequences)."""
        self.next_check = -1
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]
        self.coded = [
            [Coded(c.keys.select_batch(index), c.values.select_batch(index), c.demoted) for c in parts]
            for parts in self.coded
        ]
        if self.slots is not None:
            self.slots = [s[index] for s in self.slots]
        self.stats = {n: [x[index] for x in ph] for n, ph in self.stats.items()}
        if self.queries is not None:
            self.queries = self.queries[index]
        if self.comp_slot is not None and self.comp_count is not None:
            self.comp_slot, self.comp_count = self.comp_slot[index], self.comp_count[index]
        if self.tier is not None:
            self.tier = self.tier.select_batch(index)
