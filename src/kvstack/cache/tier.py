"""A slow tier for one layer: the tokens a retrieval method moved out of the resident cache.

Tokens live in a store (`kvstack.cache.stores`): a file on disk (an unlinked temporary file: it
leaves the process's memory, and the operating system frees it when the cache goes), or host
memory, pinned when the cache is on a GPU; in pages of `page` entries per sequence and
KV head; what stays resident is a small index of page summaries, (b, h, P, d) each in the
model's dtype: the channel-wise key minimum `lo` and maximum `hi` (Quest's bound) or the keys'
`mean` (a centroid), as the retriever asks; or (b, h, P, page) int32 the `slots` a page holds
(-1 empty), for a retriever that ranks pages by their text. A page's record holds its keys,
then its values, then its entries' slots (int32); reading it is one `readv` that scatters the
three into the keys, values and slots of every page fetched at once (no copy after the read).

File layout: page p of sequence b, head h is the record at ((p * B + b) * H + h) * record_bytes,
so a head's pages grow without moving any other head's. Entries beyond a head's count are
empty (slot -1, masked out by attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.cache.stores import HostStore, open_store

EMPTY_SLOT = -1
NO_PAGE = 1 << 30  # a page index past any tier's pages: "bring back nothing" (it stays so as pages grow)
SUMMARIES = ("lo", "hi", "mean", "slots")  # what a page's index entry may hold about its tokens


def summary_bytes(summaries: tuple[str, ...], head_dim: int, page: int, itemsize: int) -> int:
    """Bytes one page's index entry holds: d values of the model's dtype per key summary, or
    `page` int32 slots."""
    return sum(page * 4 if name == "slots" else head_dim * itemsize for name in summaries)


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor, in its dtype's layout."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@dataclass
class Fetched:
    """Pages brought back for one attention call: keys, values (b, h, n, d), slots (b, h, n) int32
    (-1 where an entry is empty), and the bytes read from the file."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    nbytes: int


class Tier:
    """The slow tier of one layer (see module docstring): `append` moves tokens in, `index` ranks
    pages, `fetch` reads the chosen ones back."""

    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        page: int,
        device: torch.device | str = "cpu",
        summaries: tuple[str, ...] = ("lo", "hi"),
        bits: int = 16,
        store: str = "auto",
    ) -> None:
        self.batch, self.heads, self.head_dim, self.dtype, self.page = batch, heads, head_dim, dtype, page
        assert bits in (8, 16), bits
        self.bits = bits
        assert summaries and set(summaries) <= set(SUMMARIES), summaries
        self.count = torch.zeros(batch, heads, dtype=torch.long)  # entries per (b, h), on the CPU
        # the resident index, on the model's device: name -> (b, h, P, d) one summary per page
        # ((b, h, P, page) int32 for "slots")
        self.index = {name: self._blank(name, batch, 0, device) for name in summaries}
        self.device = torch.device(device)
        # what a token stores, field by field: name -> (dtype, values per token); a page's record
        # holds each field's `page` entries in turn (all keys, all values, ..., all slots)
        if bits == 16:  # as the model holds them
            self.fields = {"keys": (dtype, head_dim), "values": (dtype, head_dim), "slots": (torch.int32, 1)}
        else:  # int8 codes with one float16 scale per token and vector (absmax / 127)
            codes, scale = (torch.int8, head_dim), (torch.float16, 1)
            self.fields = {"keys": codes, "values": codes, "key_scale": scale, "value_scale": scale}
            self.fields["slots"] = (torch.int32, 1)
        self.field_bytes = {name: t.itemsize * n for name, (t, n) in self.fields.items()}  # per token
        self.token_bytes = sum(self.field_bytes.values())
        self.record_bytes = page * self.token_bytes
        self.store_kind = store
        self.store = open_store(store, self.device)
        self.read_bytes = 0  # bytes read back from the file so far
        # a retriever that remembers its last choice (LouisKV): the mean query (b, h, d) that made
        # it, in the model's dtype, and the pages (b, h, k) int32 it chose; resident, counted
        self.anchor: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None
        self.written_bytes = 0

    def _blank(self, name: str, batch: int, pages: int, device: torch.device | str) -> torch.Tensor:
        """An empty index entry for `pages` pages: zeros, or slots -1."""
        if name == "slots":
            return torch.full((batch, self.heads, pages, self.page), EMPTY_SLOT, dtype=torch.int32, device=device)
        return torch.zeros(batch, self.heads, pages, self.head_dim, dtype=self.dtype, device=device)

    # ---- geometry --------------------------------------------------------------------------
    @property
    def pages(self) -> torch.Tensor:
        """(b, h) pages each head has filled (the last one maybe in part)."""
        return (self.count + self.page - 1) // self.page

    @property
    def n_pages(self) -> int:
        """Pages of the longest head: the index's length P."""
        return int(next(iter(self.index.values())).shape[2])

    def _offset(self, p: int, b: int, h: int) -> int:
        return ((p * self.batch + b) * self.heads + h) * self.record_bytes

    # ---- writing ---------------------------------------------------------------------------
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        moved: torch.Tensor,
        order: torch.Tensor | None = None,
    ) -> None:
        """Move the tokens where `moved` (b, h, t) is True into the tier, per head in the order of
        `order` (b, h, t) (ties and None: slot order), so a page holds tokens adjacent in that
        order: keys, values (b, h, t, d) in the model's dtype, slots (b, h, t)."""
        counts = moved.sum(-1).cpu()
        if not bool(counts.any()):
            return
        new_count = self.count + counts
        self._grow(int(((new_count + self.page - 1) // self.page).max()))
        for b in range(self.batch):
            for h in range(self.heads):
                if not int(counts[b, h]):
                    continue
                take = moved[b, h].nonzero().squeeze(-1)
                take = take[torch.argsort(slots[b, h, take], stable=True)]
                if order is not None:
                    take = take[torch.argsort(order[b, h, take], stable=True)]
                data = self._encode(keys[b, h, take].cpu(), values[b, h, take].cpu(), slots[b, h, take].cpu())
                at = int(self.count[b, h])
                done = 0
                while done < len(take):  # page by page: fill the current page, then the next
                    p, inside = divmod(at + done, self.page)
                    n = min(self.page - inside, len(take) - done)
                    start = self._offset(p, b, h)
                    for name, tensor in data.items():  # each field's entries `inside`.. of the page
                        self.store.write(_raw(tensor[done : done + n]), start + inside * self.field_bytes[name])
                        start += self.page * self.field_bytes[name]
                    self.written_bytes += n * self.token_bytes
                    self._summarise(b, h, p, inside, keys[b, h, take[done : done + n]], data["slots"][done : done + n])
                    done += n
        self.count = new_count

    def _encode(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Field name -> (n, ...) what n tokens store: keys, values (n, d) and slots (n,)."""
        out = {"slots": slots.to(torch.int32)}
        for name, x in (("keys", keys), ("values", values)):
            if self.bits == 16:
                out[name] = x.to(self.dtype)
                continue
            scale = (x.float().abs().amax(-1) / 127).clamp(min=1e-8).to(torch.float16)  # (n,)
            out[name] = (x.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
            out[f"{name[:-1]}_scale"] = scale  # key_scale, value_scale
        return {name: out[name] for name in self.fields}

    def _summarise(self, b: int, h: int, p: int, inside: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Take keys (n, d) and slots (n,), written at entries `inside`.. of page p of (b, h), into
        its summaries."""
        k = keys.to(self.device).float()
        for name, table in self.index.items():
            if name == "slots":
                table[b, h, p, inside : inside + len(slots)] = slots.to(self.device)
                continue
            old = table[b, h, p].float()
            if name == "lo":
                new = k.amin(0) if not inside else torch.minimum(k.amin(0), old)
            elif name == "hi":
                new = k.amax(0) if not inside else torch.maximum(k.amax(0), old)
            else:  # the running mean over the page's entries
                new = (old * inside + k.sum(0)) / (inside + len(k))
            table[b, h, p] = new.to(self.dtype)

    def _grow(self, pages: int) -> None:
        """Make the index hold `pages` pages per head (zeros for pages not yet written)."""
        extra = pages - self.n_pages
        if extra > 0:
            for name, table in self.index.items():
                self.index[name] = torch.cat([table, self._blank(name, self.batch, extra, table.device)], dim=2)

    # ---- reading ---------------------------------------------------------------------------
    def fetch(self, pages: torch.Tensor) -> Fetched:
        """Read pages (b, h, k) (indices; a page a head has not filled comes back empty) back
        from the store: from a file, one `preadv` per page into one buffer, then views of it;
        from host memory, one gather of every page's record."""
        b, h, k = pages.shape
        chosen, filled = pages.cpu(), self.pages
        if isinstance(self.store, HostStore):
            got, read = self._gather(chosen, filled)
        else:
            got, read = self._read(chosen, filled)
        self.read_bytes += read
        entry = chosen[..., None].long() * self.page + torch.arange(self.page)  # (b, h, k, page) entry numbers
        unfilled = (entry >= self.count[..., None, None]).reshape(b, h, k * self.page)
        slots = got["slots"].squeeze(-1)
        slots.masked_fill_(unfilled, EMPTY_SLOT)  # entries past a head's count (a page in part, or none)
        keys, values = got["keys"], got["values"]
        if self.bits == 8:  # codes times their token's scale, in the model's dtype
            keys = (keys.float() * got["key_scale"].float()).to(self.dtype)
            values = (values.float() * got["value_scale"].float()).to(self.dtype)
        return Fetched(keys, values, slots, read)

    def _read(self, chosen: torch.Tensor, filled: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
        """Each field (b, h, k * page, width) of pages chosen (b, h, k) read from a file page by
        page, and the bytes read."""
        b, h, k = chosen.shape
        n = k * self.page
        got = {name: torch.zeros(b, h, n, width, dtype=t) for name, (t, width) in self.fields.items()}
        views = {name: memoryview(t.view(torch.uint8).numpy()).cast("B") for name, t in got.items()}
        wanted, have = chosen.tolist(), filled.tolist()  # plain ints: indexing tensors per page costs more
        sizes = [(views[name], self.page * self.field_bytes[name]) for name in self.fields]
        record, read, row = self.record_bytes, 0, 0
        for bi in range(b):
            for hi in range(h):
                base = bi * h + hi
                for p in wanted[bi][hi]:
                    if p < have[bi][hi]:  # the page's place among those fetched is `row`: one read, every field
                        parts = [view[row * size : (row + 1) * size] for view, size in sizes]
                        read += self.store.readv(parts, (p * b * h + base) * record)
                    row += 1
        return got, read

    def _gather(self, chosen: torch.Tensor, filled: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
        """Each field (b, h, k * page, width) of pages chosen (b, h, k) gathered from host memory
        in one index (into page-locked memory where the store is pinned), and the bytes read."""
        b, h, k = chosen.shape
        store, record = self.store, self.record_bytes
        assert isinstance(store, HostStore)
        head = torch.arange(b * h).view(b, h, 1)
        ids = chosen.long() * (b * h) + head  # (b, h, k) record numbers ((p * B + b) * H + h)
        real = chosen.long() < filled[..., None]  # pages the head has filled
        rows = store.records(torch.where(real, ids, 0).flatten(), record)  # (b * h * k, record)
        rows.index_fill_(0, (~real).flatten().nonzero().squeeze(-1), 0)
        got, at = {}, 0
        for name, (dtype, width) in self.fields.items():
            size = self.page * self.field_bytes[name]
            field = torch.empty(len(rows), size, dtype=torch.uint8, pin_memory=store.pinned)
            field.copy_(rows[:, at : at + size])
            got[name] = field.view(dtype).view(b, h, k * self.page, width)
            at += size
        starts = (ids[real] * record).clamp(max=store.size)  # as a file reads: short where the writes stop
        return got, int(((starts + record).clamp(max=store.size) - starts).sum())

    def page_valid(self) -> torch.Tensor:
        """(b, h, P) True for pages a head has filled (on the index's device)."""
        return (torch.arange(self.n_pages) < self.pages.unsqueeze(-1)).to(self.device)

    # ---- bookkeeping -----------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """What stays resident: the page index, the entry counts and a remembered choice."""
        remembered = [t for t in (self.anchor, self.chosen) if t is not None]
        return [*self.index.values(), self.count, *remembered]

    def offloaded_nbytes(self) -> int:
        """Bytes the file holds for filled entries (keys, values and slots)."""
        return int(self.count.sum()) * self.token_bytes

    def copy(self) -> Tier:
        """A tier that evolves on its own: the file copied, the index cloned."""
        new = self._like(self.batch)
        new.store = self.store.clone()
        new.count, new.index = self.count.clone(), {n: t.clone() for n, t in self.index.items()}
        new.anchor, new.chosen = (None, None) if self.anchor is None else (self.anchor.clone(), self.chosen.clone())
        return new

    def _like(self, batch: int) -> Tier:
        index = tuple(self.index)
        return Tier(
            batch, self.heads, self.head_dim, self.dtype, self.page, self.device, index, self.bits, self.store_kind
        )

    def select_batch(self, index: torch.Tensor) -> Tier:
        """A tier holding only the sequences in `index` (b',), in that order."""
        rows = index.cpu().tolist()
        new = self._like(len(rows))
        new._grow(self.n_pages)
        for nb, b in enumerate(rows):
            for h in range(self.heads):
                for p in range(int(self.pages[b, h])):
                    new.store.write(self.store.read(self.record_bytes, self._offset(p, b, h)), new._offset(p, nb, h))
        new.count = self.count[rows].clone()
        new.index = {n: t[index.to(self.device)].clone() for n, t in self.index.items()}
        if self.anchor is not None and self.chosen is not None:
            new.anchor, new.chosen = self.anchor[index.to(self.device)].clone(), self.chosen[index.cpu()].clone()
        return new
