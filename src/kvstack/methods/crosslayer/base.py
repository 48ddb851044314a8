"""Cross-layer stages: a group of adjacent layers stores what their states share once.

A cross-layer stage has `join(cache, layer, decoding)`, which the cache calls after each layer's
own maintenance (sliding-window trim, eviction to the budget, encoding), at prefill and while
decoding. Layers form groups (`layer_groups`: consecutive layers of the same attention kind, from
`start` of the depth on); once every layer of a group has the prompt, `join_group` moves tokens
out of the model's dtype into encoded parts (`Coded`) whose codec reads rows of tables that are
the SAME tensors in every member (layer, head) of the group (`TableCodec`: per token a row index
and the member's own tensors), so `KVCache.nbytes()` (distinct storages over all layers) counts
the tables once, and `layer.nbytes()` of each member counts them again.

What is joined: prompt tokens (slots below `prompt_end`), not exempt, that every member holds in
the model's dtype (`shared_plain`), each slot range once (a watermark per layer, `JOINED`, so a
fork or `compress_all` never joins a token twice). Tokens that arrive while decoding stay plain.
A storage stage in the same stack (`minicache+kivi(bits=2)`) encodes each layer's oldest tokens
during that layer's own maintenance, before its group joins: only what it left plain (its
residual window) is joined, so a token is encoded by one stage or the other, never both.
Slots move with their tokens (`move_to_part`), so positions never change. A later eviction or
window trim gathers each member's rows (its own tensors), never the shared tables; once under 3/4
of a table's rows are still read, `compact_tables` rebuilds it without the dead ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from kvstack.cache.coded import Coded, compact
from kvstack.cache.encoded import Codec, Encoded, gather_rows
from kvstack.cache.layer import SLOT_DTYPE
from kvstack.errors import UserError
from kvstack.methods.base import Stage

if TYPE_CHECKING:
    from kvstack.cache.cache import KVCache
    from kvstack.cache.layer import CompressedLayer
    from kvstack.cache.sequence import SequenceState

JOINED = "joined_until"  # attribute of a CompressedLayer: slots below it were considered for joining


def layer_groups(sliding: list[bool], start: float, size: int) -> list[list[int]]:
    """Groups of `size` consecutive layers of the same kind (sliding or full attention) among the
    layers from round(start x L) on, in order of their last layer; a kind's last group may be
    smaller. sliding: per layer, True for a sliding-window layer."""
    first = round(start * len(sliding))
    groups: list[list[int]] = []
    for kind in (False, True):
        members = [i for i, s in enumerate(sliding) if s == kind and i >= first]
        groups += [members[i : i + size] for i in range(0, len(members), size)]
    return sorted(groups, key=lambda g: g[-1])


def plain_positions(layer: CompressedLayer, h: int, lo: int, hi: int) -> torch.Tensor:
    """(b, hi - lo) for each slot of [lo, hi), its position among head h's tokens held in the
    model's dtype (the plain part, after the encoded parts), or -1 when the head does not hold it
    there."""
    b, plain = layer.batch, layer.keys[h].shape[1]
    slots = layer.head_slots(h).expand(b, -1)[:, layer.head_len(h) - plain :]
    inside = (slots >= lo) & (slots < hi)
    at = torch.where(inside, slots - lo, hi - lo)  # outside the range: a spare column, dropped
    out = torch.full((b, hi - lo + 1), -1, dtype=torch.long, device=slots.device)
    out.scatter_(1, at.long(), torch.arange(plain, device=slots.device).expand(b, -1))
    return out[:, :-1]


def shared_plain(
    members: list[tuple[CompressedLayer, int]], lo: int, hi: int, seq: SequenceState
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(candidate (b, n), positions): the slots of [lo, hi) (n = hi - lo) that every member
    (layer, head) holds in the model's dtype and that are not exempt, and per member the plain
    position of each slot (`plain_positions`)."""
    positions = [plain_positions(layer, h, lo, hi) for layer, h in members]
    candidate = torch.stack(positions).ge(0).all(0)
    if seq.exempt:
        slots = torch.arange(lo, hi, device=candidate.device)
        candidate = candidate & ~seq.is_exempt(slots).unsqueeze(0)
    return candidate, positions


def real_tokens(seq: SequenceState, slots: torch.Tensor) -> torch.Tensor:
    """Bool like slots (b, k): True where the slot holds a real token (not padding)."""
    if seq.padding is None:
        return torch.ones_like(slots, dtype=torch.bool)
    return torch.gather(seq.padding.bool(), 1, slots.long())


def token_positions(seq: SequenceState, slots: torch.Tensor) -> torch.Tensor:
    """(b, k) each slot's position in its sequence (padding not counted), as RoPE saw it."""
    index = seq.token_index()
    return slots.long() if index is None else torch.gather(index, 1, slots.long())


def move_to_part(layer: CompressedLayer, h: int, index: torch.Tensor, part: Coded) -> None:
    """Move head h's plain tokens at plain positions `index` (b, k) (distinct per row) into the
    encoded part `part` (which holds them in that order), appended after the head's other encoded
    parts; the rest stay plain in their order. Slots and statistics follow the tokens; slots stay
    implicit while storage keeps slot order."""
    b, k = index.shape
    plain = layer.keys[h].shape[1]
    coded = layer.head_len(h) - plain
    device = index.device
    stays = torch.ones(b, plain, dtype=torch.bool, device=device).scatter(1, index, False)
    rest, _ = compact(torch.arange(plain, device=device).expand(b, -1), stays)
    rest = rest[:, : plain - k]
    in_order = torch.equal(index, torch.arange(k, device=device).expand(b, -1))
    if not (in_order and layer.slots is None):
        order = torch.cat([torch.arange(coded, device=device).expand(b, -1), coded + index, coded + rest], 1)
        if layer.slots is None:
            layer.slots = [layer.head_slots(i).expand(b, -1).to(SLOT_DTYPE) for i in range(layer.n_kv_heads)]
        layer.slots[h] = torch.gather(layer.slots[h].expand(b, -1), 1, order)
        for per_head in layer.stats.values():
            per_head[h] = torch.gather(per_head[h], 1, order)
    layer.keys = layer.keys.with_head(h, gather_rows(layer.keys[h], rest))
    layer.values = layer.values.with_head(h, gather_rows(layer.values[h], rest))
    layer.coded[h] = [*layer.coded[h], part]


def row_dtype(n: int) -> torch.dtype:
    """The integer type of rows into a table of n rows: int16 while they fit, else int32."""
    return torch.int16 if n < 2**15 else torch.int32


def row_index(n: int, batch: int, device: torch.device) -> torch.Tensor:
    """(b, n) rows 0..n-1 of a shared table."""
    return torch.arange(n, device=device, dtype=row_dtype(n)).expand(batch, -1).contiguous()


class TableCodec(Codec):
    """A codec whose tokens read rows of tables shared by a group's members: each token holds
    its `row` (b, n) and its own tensors; `tables` name the shared tensors (b, N, ...) that rows
    index. An eviction gathers the rows, never the tables, so the sharing survives it."""

    tables: ClassVar[tuple[str, ...]] = ()
    turnable = False  # its tables are shared by other layers

    def rows(self, enc: Encoded, name: str) -> torch.Tensor:
        """(b, n, ...) the table `name` read at each token's row."""
        table, row = enc.shared[name], enc.tokens["row"].long()
        return gather_rows(table, row) if table.dim() > 2 else torch.gather(table, 1, row)


def compact_tables(layers: list[CompressedLayer]) -> None:
    """Rebuild the shared tables of `layers`' parts (one set per codec: a join's) once fewer than
    3/4 of their rows are still read by some member (evictions, window trims), so dead rows are
    freed; every member's rows are renumbered. The members must be all the codec's readers."""
    readers: dict[int, list[tuple[CompressedLayer, int, int, str]]] = {}
    for layer in layers:
        for h in range(layer.n_kv_heads):
            for i, part in enumerate(layer.coded[h]):
                for kind in ("keys", "values"):
                    if isinstance(getattr(part, kind).codec, TableCodec):
                        readers.setdefault(id(getattr(part, kind).codec), []).append((layer, h, i, kind))
    for members in readers.values():
        encs = [getattr(layer.coded[h][i], kind) for layer, h, i, kind in members]
        codec = encs[0].codec
        assert isinstance(codec, TableCodec)
        names = [name for name in codec.tables if name in encs[0].shared]
        size = encs[0].shared[names[0]].shape[1]
        if all(enc.n == size for enc in encs):
            continue
        b, device = encs[0].tokens["row"].shape[0], encs[0].tokens["row"].device
        live = torch.zeros(b, size, dtype=torch.bool, device=device)
        for enc in encs:
            live.scatter_(1, enc.tokens["row"].long(), True)
        if int(live.sum(1).max()) >= 0.75 * size:
            continue
        old, _ = compact(torch.arange(size, device=device).expand(b, -1), live)  # (b, N') old row of each new one
        renumber = torch.zeros(b, size, dtype=torch.long, device=device)
        renumber.scatter_(1, old, torch.arange(old.shape[1], device=device).expand(b, -1))
        tables = {}
        for name in names:
            table = encs[0].shared[name]
            tables[name] = gather_rows(table, old) if table.dim() > 2 else torch.gather(table, 1, old)
        rows: dict[int, torch.Tensor] = {}  # one new row tensor per old one: keys and values keep sharing it
        for (layer, h, i, kind), enc in zip(members, encs, strict=True):
            row = enc.tokens["row"]
            if id(row) not in rows:
                rows[id(row)] = torch.gather(renumber, 1, row.long()).to(row_dtype(old.shape[1]))
            new = replace(enc, tokens={**enc.tokens, "row": rows[id(row)]}, shared={**enc.shared, **tables})
            part = layer.coded[h][i]
            parts = list(layer.coded[h])
            parts[i] = Coded(new, part.values, part.demoted) if kind == "keys" else Coded(part.keys, new, part.demoted)
            layer.coded[h] = parts


@dataclass
class CrossLayer(Stage):
    """Base of the cross-layer stages (see module docstring): `groups` says which layers join,
    `join_group` joins one group's tokens in slots [lo, hi)."""

    family: ClassVar[str] = "crosslayer"
    role: ClassVar[str] = "joiner"

    def groups(self, sliding: list[bool]) -> list[list[int]]:
        raise NotImplementedError

    def join_group(self, layers: list[CompressedLayer], lo: int, hi: int) -> None:
        raise NotImplementedError

    def join(self, cache: KVCache, layer: CompressedLayer, decoding: bool) -> None:
        """Join every group whose last layer is `layer` (every complete group at the model's last
        layer, so a whole-prompt compression is caught up), then free the shared rows no member
        reads any more."""
        if cache.stack.evictor is None and cache.stack.quantizer is None and not cache.budget.is_full:
            raise UserError(
                f"{cache.stack.label} compresses by its own ratio and evicts nothing, so budget {cache.budget} "
                f"is out of reach: use budget 1.0 or add an eviction stage (snapkv+{cache.stack.label})"
            )
        last = layer.layer_idx == len(cache.layers) - 1
        if not decoding and cache.stack.whole_prompt and cache.stack.evictor is not None and not cache.budget.is_full:
            if not last or cache.policy.shares.weights is None:  # the allocator has not compressed the prompt yet
                return
        for group in self.groups([m.is_sliding for m in cache.layers]):
            if group[-1] != layer.layer_idx and not (last and group[-1] < layer.layer_idx):
                continue
            members = [cache.layers[i] for i in group]
            if not all(m.is_initialized for m in members):
                continue
            lo = min(getattr(m, JOINED, 0) for m in members)
            hi = min(cache.seq.prompt_end, *(m.seen for m in members))
            if hi > lo:
                self.join_group(members, lo, hi)
                for m in members:
                    setattr(m, JOINED, hi)
            compact_tables(members)
