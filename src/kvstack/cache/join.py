"""Caches' layers joined in order: the storage half of reusing documents cached apart (KVLink and
RelayCaching, `kvstack.reuse`).

A source layer's tokens keep their storage (plain, encoded parts, statistics) and move to slots
after what the target already holds (`shift`). Keys are stored after RoPE, at the positions their
own prefill gave them (from 0); with `rotate_keys` each source's keys are turned by its shift, so
they read as if computed at their place in the joined sequence: exact for plain keys, up to the
codec's rounding for encoded ones (decoded, turned and encoded again with their own codec).
"""

from __future__ import annotations

import torch

from kvstack.cache.coded import Coded
from kvstack.cache.keep import Keep
from kvstack.cache.layer import SLOT_DTYPE, CompressedLayer
from kvstack.cache.sequence import SequenceState
from kvstack.errors import UserError
from kvstack.models.rope import rotate


def slot_range(layer: CompressedLayer, lo: int, hi: int) -> CompressedLayer:
    """A copy of `layer` holding only its tokens at slots [lo, hi) (tensors of the original untouched)."""
    window = layer.queries.shape[2] if layer.queries is not None else 0
    out = layer.copy(SequenceState(), frozenset(layer.stats), window)
    slots = out.dense_slots()
    inside = out.valid_mask(slots) & (slots >= lo) & (slots < hi)
    if not bool(inside.eq(out.valid_mask(slots)).all()):
        order = torch.argsort((~inside).to(torch.int8), dim=-1, stable=True)
        out.apply(Keep(index=order, count=inside.sum(-1)))
    return out


def append_layer(into: CompressedLayer, source: CompressedLayer, shift: int, end: int, rotate_keys: bool) -> None:
    """Put `source`'s tokens after what `into` holds, at their slots + `shift` (with `rotate_keys`,
    their keys turned by `shift` positions); `into` then has seen `end` slots."""
    if source.comp_slot is not None or into.comp_slot is not None:
        raise UserError("a cache with compensation tokens (razor) cannot be joined: its averages span one document")
    if source.batch != 1 or (into.is_initialized and into.batch != 1):
        raise UserError(f"only single-sequence caches can be joined (this one holds {source.batch})")
    if rotate_keys and shift and source.inv_freq is None:
        raise UserError("the model's RoPE frequencies are unknown, so positions cannot be re-encoded: join without")
    sources, shifts = ([into, source], [0, shift]) if into.is_initialized else ([source], [shift])
    names = set.intersection(*(set(layer.stats) for layer in sources))
    keys, values, coded, slots = [], [], [], []
    stats: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for h in range(into.n_kv_heads):
        parts: list[Coded] = []
        plain_k, plain_v, front, back = [], [], [], []  # front: encoded parts' slots and stats; back: plain's
        front_stats: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        back_stats: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for layer, by in zip(sources, shifts, strict=True):
            turn = rotate_keys and by != 0
            n_coded = sum(c.n for c in layer.coded[h])
            parts += [_turned(part, by, layer.inv_freq) if turn else part for part in layer.coded[h]]
            k = layer.keys[h]
            plain_k.append(rotate(k, by, layer.inv_freq) if turn else k)
            plain_v.append(layer.values[h])
            s = layer.head_slots(h).expand(1, -1)
            s = torch.where(s >= 0, s + by, s)
            front.append(s[:, :n_coded])
            back.append(s[:, n_coded:])
            for name in names:
                front_stats[name].append(layer.stats[name][h][:, :n_coded])
                back_stats[name].append(layer.stats[name][h][:, n_coded:])
        keys.append(torch.cat(plain_k, dim=1))
        values.append(torch.cat(plain_v, dim=1))
        coded.append(parts)
        slots.append(torch.cat(front + back, dim=1).to(SLOT_DTYPE))
        for name in names:
            stats[name].append(torch.cat(front_stats[name] + back_stats[name], dim=1))
    into.keys, into.values, into.coded, into.stats, into.seen = keys, values, coded, stats, end
    into.slots, into.start = _implicit(slots) or (slots, 0)
    if source.queries is not None and source.query_slots is not None:  # the latest, for scorers reading them
        into.queries, into.query_slots = source.queries, source.query_slots + shift
    into.next_check = -1


def _implicit(slots: list[torch.Tensor]) -> tuple[None, int] | None:
    """(None, first slot) when every head holds one contiguous run of slots (as a full cache does:
    slots stay implicit, zero bytes), else None."""
    first = slots[0]
    if first.shape[1] == 0 or any(not torch.equal(s, first) for s in slots[1:]):
        return None
    start = int(first[0, 0])
    if not torch.equal(first[0].long(), torch.arange(start, start + first.shape[1], device=first.device)):
        return None
    return None, start


def _turned(part: Coded, shift: int, inv_freq: torch.Tensor | None) -> Coded:
    """An encoded part with its keys decoded, turned by `shift` positions and encoded again."""
    enc = part.keys
    if not enc.codec.turnable:
        raise UserError(f"keys coded by {enc.codec!r} cannot move to new positions: join without re-encoding")
    assert inv_freq is not None
    turned = rotate(enc.decode(torch.float32), shift, inv_freq).to(enc.dtype)
    return Coded(enc.codec.encode(turned, enc.where), part.values, part.demoted)
