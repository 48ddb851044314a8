"""Fixed-shape storage for decoding: one layer's slab and the one call that attends over it.

A slab holds a layer's keys and values (b, h, capacity, d) and each place's slot (b, h, capacity)
(-1: empty), allocated once; a decoding step writes each head's new token at that head's length,
in place, and attends over the whole slab masked by slot. Nothing is created, grown or freed by
a step, so `torch.compile` traces it once (`kvstack.cache.slab_cache` fills and keeps slabs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstack.cache.layer import SLOT_DTYPE

ROOM = 2  # places per head beyond its share: the step's new token before the policy evicts, and one to spare


@dataclass
class SlabLayer:
    """One layer's fixed storage: keys, values (b, h, capacity, d), slots (b, h, capacity) with -1
    where empty, `length` (h,) each head's next place (on the device, moved by the step), `used`
    the same on the host (moved between steps), and a ring of the last w observed queries
    (b, h*g, w, d) with their slots (w,) when the stack scores by them."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    length: torch.Tensor
    used: list[int]
    window: int | None
    queries: torch.Tensor | None = None
    query_slots: torch.Tensor | None = None
    observed: int = 0  # places of the ring that hold a query (the newest last), on the host

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """What this layer keeps alive for attention (what `SlabCache.nbytes` counts)."""
        return [self.keys, self.values, self.slots, self.length]


@dataclass
class SlabView:
    """What `SlabCache.update` hands to the attention: the layer's slab and the new queries' slots (q,)."""

    layer: SlabLayer
    query_slots: torch.Tensor


def attend(query: torch.Tensor, view: SlabView, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of query (b, h*g, q, d) over one layer's slab in one call: the g query heads of
    each KV head attend as g*q queries of one head, masked by slot (empty, future, outside the
    sliding window the model passes, else the layer's). On CPU logits and softmax in float32, as
    `few_queries`; on a GPU one SDPA call in the model's dtype. Returns (b, q, h*g, d). The
    step's queries enter the layer's ring of observed queries."""
    slab = view.layer
    window = window if window is not None else slab.window
    b, hg, q, d = query.shape
    h, capacity = slab.keys.shape[1], slab.keys.shape[2]
    g = hg // h
    query_slots = view.query_slots.to(SLOT_DTYPE).view(1, 1, q, 1)
    key_slots = slab.slots.unsqueeze(2)  # (b, h, 1, capacity)
    allowed = (key_slots >= 0) & (key_slots <= query_slots)
    if window is not None:
        allowed = allowed & (key_slots > query_slots - window)
    grouped = query.reshape(b, h, g * q, d)
    if query.is_cuda:
        mask = allowed.unsqueeze(2).expand(b, h, g, q, capacity).reshape(b, h, g * q, capacity)
        out = F.scaled_dot_product_attention(grouped, slab.keys, slab.values, attn_mask=mask, scale=scale)
    else:
        logits = torch.matmul(grouped.float(), slab.keys.float().transpose(-1, -2)).view(b, h, g, q, capacity)
        logits = (logits * scale).masked_fill(~allowed.unsqueeze(2), float("-inf"))
        probs = torch.softmax(logits, dim=-1).view(b, h, g * q, capacity)
        out = torch.matmul(probs.to(slab.values.dtype), slab.values)
    if slab.queries is not None and slab.query_slots is not None:
        w = slab.queries.shape[2]
        slab.queries.copy_(torch.cat([slab.queries, query.to(slab.queries.dtype)], dim=2)[:, :, -w:])
        slab.query_slots.copy_(torch.cat([slab.query_slots, view.query_slots.to(slab.query_slots.dtype)])[-w:])
    return out.reshape(b, hg, q, -1).transpose(1, 2).contiguous().to(query.dtype)
