"""Attention over a kvstack cache, registered with transformers as `attn_implementation="kvstack"`.

Each KV head attends over its own kept tokens; masks come from each token's logical slot
(causality, sliding window, padding), so heads may hold different tokens. After attending,
the layer's cache records what its methods need (see `statistics`) and compresses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvstack.cache.encoded import Turned
from kvstack.cache.levels import LevelCodes
from kvstack.cache.packed import Packed, attend_head
from kvstack.cache.slab import SlabView, attend

if TYPE_CHECKING:
    from kvstack.cache.cache import KVCache
    from kvstack.cache.layer import CompressedLayer, Part
    from kvstack.cache.tier import Fetched

ATTENTION = "kvstack"


@dataclass
class LayerView:
    """What `KVCache.update` hands to the attention function: the layer and the new queries' slots."""

    layer: CompressedLayer
    cache: KVCache
    query_slots: torch.Tensor  # (q,)
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values (b, h, q, d) of a layer's first chunk


def padding_passthrough(
    batch_size: int,
    cache_position: torch.Tensor,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask 'builder' for kvstack: pass the 2D padding mask (b, slots) through unchanged."""
    if attention_mask is None or attention_mask.all():
        return None
    return attention_mask.to(torch.bool)


def head_mask(
    key_slots: torch.Tensor, query_slots: torch.Tensor, padding: torch.Tensor | None, window: int | None
) -> torch.Tensor:
    """(b or 1, 1, q, t) True where a query may attend a key, from slots alone.

    key_slots: (b, t) or (t,); query_slots: (q,); padding: (b, slots) real-token mask or None.
    A sliding window counts real tokens, so padding inside a batch does not shift it.
    """
    ks = key_slots if key_slots.dim() == 2 else key_slots.unsqueeze(0)
    k, q = ks[:, None, :], query_slots[None, :, None]
    allowed = (k <= q) & (k >= 0)
    if padding is not None:
        b = padding.shape[0]
        real = torch.gather(padding, 1, ks.clamp(min=0).expand(b, -1))
        allowed = allowed & real[:, None, :]
        if window is not None:
            index = padding.long().cumsum(-1)  # (b, slots) real tokens up to each slot
            k_index = torch.gather(index, 1, ks.clamp(min=0).expand(b, -1))[:, None, :]
            allowed &= k_index > index[:, query_slots][:, :, None] - window
    elif window is not None:
        allowed &= k > q - window
    # a padding query sees nothing: let it see everything rather than produce NaN
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return allowed.unsqueeze(1)


def layer_mask(
    layer: CompressedLayer, query_slots: torch.Tensor, padding: torch.Tensor | None, window: int | None
) -> torch.Tensor:
    """(b or 1, h or 1, q, t) `head_mask` for every head of a layer whose heads hold the same length."""
    if layer.slots is None:  # implicit slots: the same for every head
        return head_mask(layer.head_slots(0), query_slots, padding, window)
    slots = torch.stack([s.long() for s in layer.slots], dim=1)  # (b, h, t)
    b, h, t = slots.shape
    mask = head_mask(slots.reshape(b, h * t), query_slots, padding, window)  # (b, 1, q, h*t)
    return mask.view(mask.shape[0], -1, h, t).transpose(1, 2)


def attention_probs(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(b, g, q, t) softmax attention in float32 for query (b, g, q, d), keys (b, t, d).

    bias: (b, t) added to the logits (a merged entry's log-count), or None. The product runs in
    the model's dtype (bf16 matmuls are 2-4x faster on CPU), the softmax in float32.
    """
    logits = torch.matmul(query, keys.unsqueeze(1).transpose(-1, -2)).float() * scaling
    if bias is not None:
        logits = logits + bias[:, None, None, :]
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


FEW_QUERIES = 8  # up to this many new queries, attention runs as `few_queries`


def few_queries(
    query: torch.Tensor,
    keys: Sequence[Part],
    values: Sequence[Part],
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """(b, h*g, q, dv) attention of a few queries (b, h*g, q, d) over keys, values given as parts
    along the tokens, each (b, h, t_i, d) (a layer's decoded codes, then its newest tokens): the
    g query heads of KV head h attend its keys.

    Logits and softmax in float32, the probabilities times values in the values' dtype (the
    model's, as flash kernels do; float32 once some parts were decoded from codes). Logits are
    taken part by part and joined, so parts are never copied into one tensor. A `Turned` part
    (tokens y R^T held as y) is read with the query turned, q R, and its share of the output
    turned back, (p y) R^T: two (d, d) products per step instead of one per token. A `Packed` part
    (integer codes) or a `LevelCodes` part (codes of a table of levels) is read by its kernel,
    with no float copy of its tokens. On CPU, SDPA's bf16 kernel with one query takes ~6 ms over
    8k keys where these batched products take ~0.7 ms.
    mask: (b or 1, h or 1, q, t) True where a key may be seen; bias: (b, h, t) log-counts added
    to the logits (merged entries), or None.
    """
    b, hg, q, d = query.shape
    h = keys[0].shape[1]
    g = hg // h
    plain = len(keys) == 1 and isinstance(keys[0], torch.Tensor) and isinstance(values[0], torch.Tensor)
    if query.is_cuda and plain and bias is None and keys[0].dtype == values[0].dtype == query.dtype:
        return grouped_sdpa(query, keys[0], values[0], mask, scale)  # a GPU's fused kernel: one launch, not ten
    flat_query = query.reshape(b * h, g * q, d).float()
    parts = []
    for k in keys:  # (b*h, g*q, d) @ (b*h, d, t_i): keys are not broadcast over the group (that would copy them)
        if isinstance(k, Packed | LevelCodes):
            parts.append(k.logits(flat_query))
            continue
        turned = isinstance(k, Turned)  # tokens y @ R^T: the query turns, q R, not every token
        kq, kt = (flat_query @ k.basis, k.y) if turned else (flat_query, k)
        parts.append(torch.bmm(kq, kt.float().reshape(b * h, kt.shape[2], d).transpose(1, 2)))
    t = sum(p.shape[-1] for p in parts)
    logits = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).view(b, h, g, q, t) * scale
    if bias is not None:
        logits = logits + bias[:, :, None, None, :]
    if mask is not None:
        logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).view(b * h, g * q, t)
    dtype = values[0].dtype if len(values) == 1 and isinstance(values[0], torch.Tensor) else torch.float32
    out, at = None, 0
    for v in values:
        t_i = v.shape[2]
        if isinstance(v, Packed | LevelCodes):
            part = v.mix(probs[..., at : at + t_i])
            out, at = part if out is None else out.add_(part), at + t_i
            continue
        vt = v.y if isinstance(v, Turned) else v
        part = torch.bmm(probs[..., at : at + t_i].to(dtype), vt.to(dtype).reshape(b * h, t_i, -1))
        if isinstance(v, Turned):  # sum p y, then back from the rotated basis: (sum p y) R^T
            part = part @ v.basis.T
        out, at = part if out is None else out.add_(part), at + t_i
    assert out is not None
    return out.view(b, hg, q, -1).to(query.dtype)


def grouped_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`few_queries` over one plain part as one SDPA call: the g query heads of each KV head
    attend as g*q queries of one head, so the fused kernel needs no GQA support and keys are
    never repeated. query (b, h*g, q, d), keys/values (b, h, t, d), mask (b or 1, h or 1, q, t)
    or None; returns (b, h*g, q, dv)."""
    b, hg, q, d = query.shape
    h = keys.shape[1]
    g = hg // h
    if mask is not None:  # each query's row of the mask, repeated for the g heads that share its KV head
        mask = mask.unsqueeze(2).expand(-1, h, g, -1, -1).reshape(mask.shape[0], h, g * q, mask.shape[-1])
    out = F.scaled_dot_product_attention(query.reshape(b, h, g * q, d), keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, hg, q, -1)


def kvstack_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for query (b, h*g, q, d) over a `LayerView`, a `SlabView` (or plain (b, h, t, d) tensors).

    Returns (b, q, h*g, d) like transformers' own attention functions.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if getattr(module, "attn_logit_softcapping", None):
        raise NotImplementedError("kvstack attention does not support attention logit soft-capping yet")
    if isinstance(key, SlabView):  # fixed-shape storage: its slots mask padding, one call for the layer
        return attend(query, key, scale, sliding_window), None
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    if not isinstance(key, LayerView):  # no cache: plain causal attention over the given tensors
        t = key.shape[2]
        slots = torch.arange(t, device=query.device)
        return _attend(
            query,
            key.shape[1],
            lambda h: key[:, h],
            lambda h: value[:, h],
            lambda h: slots,
            slots[-query.shape[2] :],
            padding,
            sliding_window,
            scale,
            lambda h: None,
        ), None
    view = key
    layer, cache = view.layer, view.cache
    if padding is not None:
        cache.seq.padding = padding
    elif cache.seq.padding is not None:  # a later call without a mask: new tokens are real
        extra = layer.seen - cache.seq.padding.shape[1]
        if extra > 0:
            ones = cache.seq.padding.new_ones(cache.seq.padding.shape[0], extra)
            cache.seq.padding = torch.cat([cache.seq.padding, ones], dim=1)
    padding = cache.seq.padding
    if view.fresh is not None and query.shape[2] > FEW_QUERIES:  # a prompt's first chunk: one call, all heads
        out = _attend_fresh(query, *view.fresh, view.query_slots, padding, sliding_window, scale)
        cache.observe(layer, query, view.query_slots, padding, sliding_window, scale)
        return out, None
    # a retriever brings pages of the slow tier back for each block of a few queries (a question
    # or a chunk gets a selection per block, as decoding does per token)
    blocks = []
    for start in range(0, query.shape[2] if layer.tier is not None else 0, FEW_QUERIES):
        block = query[:, :, start : start + FEW_QUERIES]
        slots = view.query_slots[start : start + FEW_QUERIES]
        fetched = cache.retrieve(layer, block, int(slots[-1]))
        if fetched is None:  # nothing to bring back: attend the resident tokens alone
            break
        blocks.append(_attend_retrieved(block, layer, fetched, slots, padding, sliding_window, scale))
    if blocks:
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        cache.observe(layer, query, view.query_slots, padding, sliding_window, scale)
        return out, None
    alike = layer.layer_kv() if query.shape[2] <= FEW_QUERIES else None
    if alike is not None:  # every head holds the same tokens' shapes: one call for the layer
        keys, values = alike
        mask = None
        if padding is not None or sliding_window is not None or query.shape[2] > 1:
            mask = layer_mask(layer, view.query_slots, padding, sliding_window)
        out = few_queries(query, keys, values, mask, None, scale).transpose(1, 2).contiguous()
        cache.observe(layer, query, view.query_slots, padding, sliding_window, scale)
        return out, None
    out = _attend(
        query,
        layer.n_kv_heads,
        layer.head_keys,
        layer.head_values,
        layer.head_slots,
        view.query_slots,
        padding,
        sliding_window,
        scale,
        layer.head_bias,
        layer.head_parts,
    )
    cache.observe(layer, query, view.query_slots, padding, sliding_window, scale)
    return out, None


def _attend_fresh(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    padding: torch.Tensor | None,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk over itself, every head in one SDPA call (as transformers' sdpa):
    query (b, h*g, q, d), keys/values (b, h, q, d) at slots (q,). Returns (b, q, h*g, d)."""
    if padding is None and window is None:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = head_mask(slots, slots, padding, window)  # (b or 1, 1, q, q), the same for every head
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _attend_retrieved(
    query: torch.Tensor,
    layer: CompressedLayer,
    fetched: Fetched,
    query_slots: torch.Tensor,
    padding: torch.Tensor | None,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Per KV head h: its queries (b, g, q, d), q <= FEW_QUERIES, attend the pages brought back
    from the slow tier (fetched keys, values (b, h, n, d), slots (b, h, n), -1 for empty entries)
    and the resident tokens as one set, masked by slot (causality, padding, window). Returns
    (b, q, h*g, d)."""
    b, n_q_heads, q, _ = query.shape
    g = n_q_heads // layer.n_kv_heads
    out: torch.Tensor | None = None
    for h in range(layer.n_kv_heads):
        qh = query[:, h * g : (h + 1) * g]
        resident_slots = layer.head_slots(h)
        slots = torch.cat([fetched.slots[:, h].long(), resident_slots.expand(b, -1).long()], dim=1)
        keys = torch.cat([fetched.keys[:, h].to(qh.dtype), layer.head_keys(h).to(qh.dtype)], dim=1)  # (b, t, d)
        values = torch.cat([fetched.values[:, h], layer.head_values(h)], dim=1)
        if out is None:
            out = query.new_empty(b, n_q_heads, q, values.shape[-1])
        mask = head_mask(slots, query_slots, padding, window)  # (b, 1, q, t)
        out[:, h * g : (h + 1) * g] = few_queries(qh, [keys.unsqueeze(1)], [values.unsqueeze(1)], mask, None, scale)
    assert out is not None
    return out.transpose(1, 2).contiguous()


def _attend(
    query: torch.Tensor,
    n_kv_heads: int,
    keys_of: Callable[[int], torch.Tensor],
    values_of: Callable[[int], torch.Tensor],
    slots_of: Callable[[int], torch.Tensor],
    query_slots: torch.Tensor,
    padding: torch.Tensor | None,
    window: int | None,
    scale: float,
    bias_of: Callable[[int], torch.Tensor | None],
    parts_of: Callable[[int], tuple[list[Part], list[Part]]] | None = None,
) -> torch.Tensor:
    """Per KV head h: its group of queries (b, g, q, d) attends its own keys/values (b, t_h, d).

    keys_of(h), values_of(h) give head h's tensors (decoding encoded tokens one head at a time,
    so the full-precision copy never spans the whole cache); slots_of(h) gives its slots (b, t_h)
    or (t_h,), only called when a mask is needed; bias_of(h) the (b, t_h) log-counts of merged
    entries added to their logits, or None; parts_of(h), when given, head h's keys and values as
    parts along its tokens for a few queries (no copy joins them).
    """
    b, n_q_heads, q, d = query.shape
    g = n_q_heads // n_kv_heads
    out: torch.Tensor | None = None
    for h in range(n_kv_heads):
        qh = query[:, h * g : (h + 1) * g]
        if q <= FEW_QUERIES:  # decoding: two matmuls, not SDPA's kernel (see `few_queries`)
            ks, vs = parts_of(h) if parts_of is not None else ([keys_of(h)], [values_of(h)])
            if out is None:  # values may be narrower or wider than queries
                out = query.new_empty(b, n_q_heads, q, vs[0].shape[-1])
            mask = None
            if padding is not None or window is not None or q > 1:
                mask = head_mask(slots_of(h), query_slots, padding, window)
            bias = bias_of(h)
            fused = attend_head(qh, ks, vs, scale) if mask is None and bias is None else None
            if fused is not None:  # codes, then the newest plain tokens: one kernel call for the head
                out[:, h * g : (h + 1) * g] = fused
                continue
            out[:, h * g : (h + 1) * g] = few_queries(
                qh,
                [k.unsqueeze(1) for k in ks],
                [v.unsqueeze(1) for v in vs],
                mask,
                None if bias is None else bias.unsqueeze(1),
                scale,
            )
            continue
        k, v = keys_of(h), values_of(h)
        if out is None:
            out = query.new_empty(b, n_q_heads, q, v.shape[-1])
        k4, v4 = k.unsqueeze(1), v.unsqueeze(1)
        bias = bias_of(h)
        if bias is not None:  # merged entries: an additive float mask carries their log-counts
            allowed = head_mask(slots_of(h), query_slots, padding, window)  # (b or 1, 1, q, t)
            add = torch.where(allowed, bias[:, None, None, :], float("-inf")).to(qh.dtype)
            out[:, h * g : (h + 1) * g] = F.scaled_dot_product_attention(
                qh, k4, v4, attn_mask=add, scale=scale, enable_gqa=True
            )
            continue
        if q == 1 and padding is None:  # one new query sees every held token: older ones left the window
            out[:, h * g : (h + 1) * g] = F.scaled_dot_product_attention(qh, k4, v4, scale=scale, enable_gqa=True)
            continue
        ks = slots_of(h)
        if padding is None and window is None and ks.dim() == 1 and torch.equal(ks, query_slots):
            out[:, h * g : (h + 1) * g] = F.scaled_dot_product_attention(
                qh, k4, v4, is_causal=True, scale=scale, enable_gqa=True
            )
            continue
        mask = head_mask(ks, query_slots, padding, window)
        out[:, h * g : (h + 1) * g] = F.scaled_dot_product_attention(
            qh, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True
        )
    assert out is not None
    return out.transpose(1, 2).contiguous()


def register() -> None:
    """Make `attn_implementation="kvstack"` available to every transformers model."""
    AttentionInterface.register(ATTENTION, kvstack_attention)
    AttentionMaskInterface.register(ATTENTION, padding_passthrough)
