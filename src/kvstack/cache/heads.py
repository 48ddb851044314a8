"""`PerHead`: one layer's per-head tensors, held as one tensor while the heads are alike.

A layer keeps, per KV head, tensors whose length may differ between heads (ragged budgets).
While every head has the same length they are held as one (b, h, t, ...) tensor: a step
appends with one `cat` for all heads (as transformers' own cache does) and attention reads all
heads in one call. Once lengths differ they are held apart. A `PerHead` is a tuple of the
heads' tensors (views of the stacked one), never written in place: a fork of the cache shares
it until either side replaces it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PerHead(tuple[torch.Tensor, ...]):
    """Per-head tensors (b, t_h, ...), stacked as (b, h, t, ...) while every t_h is the same."""

    stacked: torch.Tensor | None  # (b, h, t, ...) when every head holds the same length, else None

    def __new__(cls, heads: Sequence[torch.Tensor] = (), stacked: torch.Tensor | None = None) -> PerHead:
        heads = list(heads)
        if stacked is None and heads and all(x.shape == heads[0].shape for x in heads):
            stacked = torch.stack(heads, dim=1)  # one copy, then views
        out = super().__new__(cls, stacked.unbind(1) if stacked is not None else heads)
        out.stacked = stacked
        return out

    @classmethod
    def of(cls, heads: Sequence[torch.Tensor]) -> PerHead:
        return heads if isinstance(heads, PerHead) else cls(heads)

    def with_head(self, h: int, x: torch.Tensor) -> PerHead:
        """A copy with head h replaced by x."""
        heads = list(self)
        heads[h] = x
        return PerHead(heads)

    def append(self, new: torch.Tensor) -> PerHead:
        """These heads followed by new (b, h, q, ...): one `cat` while they are stacked."""
        if self.stacked is not None:
            return PerHead(stacked=torch.cat([self.stacked, new], dim=2))
        return PerHead([torch.cat([x, new[:, h]], dim=1) for h, x in enumerate(self)])

    def drop_oldest(self, n: int) -> PerHead:
        """Every head without its `n` oldest tokens, copied so their storage is really freed."""
        if self.stacked is not None:
            return PerHead(stacked=self.stacked[:, :, n:].clone())
        return PerHead([x[:, n:].clone() for x in self])

    def take(self, index: torch.Tensor) -> PerHead:
        """The tokens at `index` (b, h, k) of every head, stacked (the heads must be stacked)."""
        x = self.stacked
        assert x is not None
        b, h, t = x.shape[:3]
        k = index.shape[-1]
        rows = torch.arange(b * h, device=index.device).view(b, h, 1) * t
        flat = (index.long() + rows).reshape(-1)  # index_select, not gather: no (b, h, k, d) index
        return PerHead(stacked=x.reshape(b * h * t, *x.shape[3:]).index_select(0, flat).view(b, h, k, *x.shape[3:]))

    def nbytes(self, h: int) -> int:
        """Bytes of head h's own elements (its share of a stacked tensor)."""
        x = self[h]
        return x.numel() * x.element_size()
