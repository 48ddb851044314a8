"""KVCOMM (#48, 2025): reuse a shared text's KV cache under a new prefix by adding the deviation
that a prefix was seen to cause (an anchor), instead of recomputing the text.

Paper: in multi-agent pipelines the same content reaches each agent after a different prefix; its
KV cache differs by an offset that depends on the prefix. KVCOMM keeps a pool of anchors (the
observed deviation of cached content under earlier prefixes), estimates the offset for a new
prefix from the closest anchors and adds it to the reused cache, online and training-free.

Here: an `Anchor` is one observation, the deviation of a document's keys and values inside one
full prefill (the prefix, then the document) from the same document prefilled alone with its keys
turned to that place (KVLink's re-encoding): per layer, head and token. `join` joins documents as
KVLink does, then adds each later document's anchor to the tokens it holds in the model's dtype,
the key deviation turned from the anchor's positions to the document's. Deviations: one anchor
per document rather than a pool with an estimate interpolated between several (the reuse task has
one earlier prefix per document to learn from); encoded tokens are left uncorrected; a sliding
layer corrects only the tokens both prefills held in its window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.cache.cache import KVCache
from kvstack.generate import compress_ids
from kvstack.models.rope import rotate
from kvstack.reuse.kvlink import join as kvlink_join


@dataclass
class Anchor:
    """A document's deviation after one prefix of `start` tokens: per layer (h, n, d) float32 key
    and value offsets at positions start + j (keys in RoPE space there), NaN where unobserved."""

    start: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def anchor(model: Any, prefix: list[int], document: list[int]) -> Anchor:
    """Observe `document` after `prefix`: one full prefill of both, one of the document alone."""
    inside, alone = compress_ids(model, prefix + document), compress_ids(model, document)
    start, n = len(prefix), len(document)
    keys, values = [], []
    for full, own in zip(inside.layers, alone.layers, strict=True):
        (k_in, v_in), (k_own, v_own) = _by_position(full, start, n), _by_position(own, 0, n)
        turned = rotate(k_own, start, own.inv_freq) if own.inv_freq is not None else k_own
        keys.append(k_in - turned.float())
        values.append(v_in - v_own)
    return Anchor(start, keys, values)


def _by_position(layer: Any, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) (h, n, d) float32 of a full cache's tokens at slots start..start+n, NaN where
    the layer no longer holds them (a sliding window)."""
    slots = layer.head_slots(0).expand(1, -1)[0].long()
    k = torch.full((layer.n_kv_heads, n, layer.keys[0].shape[-1]), float("nan"))
    v = k.clone()
    inside = (slots >= start) & (slots < start + n)
    at = slots[inside] - start
    for h in range(layer.n_kv_heads):
        k[h, at] = layer.keys[h][0, inside].float().cpu()
        v[h, at] = layer.values[h][0, inside].float().cpu()
    return k, v


def join(model: Any, documents: list[tuple[list[int], KVCache]], anchors: list[Anchor | None]) -> KVCache:
    """`documents` joined (KVLink, positions re-encoded), each later document corrected by its anchor."""
    joined = kvlink_join(model, documents)
    start = 0
    for (ids, _), seen in zip(documents, anchors, strict=True):
        if seen is not None:
            for layer, dk, dv in zip(joined.layers, seen.keys, seen.values, strict=True):
                turned = (
                    dk.nan_to_num()
                    if layer.inv_freq is None
                    else rotate(dk.nan_to_num(), start - seen.start, layer.inv_freq)
                )
                _correct(layer, start, len(ids), turned, dv)
        start += len(ids)
    return joined


def _correct(layer: Any, start: int, n: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add offsets dk, dv (h, n, d) to the layer's plain tokens at slots start..start+n (NaN: none)."""
    keys, values = list(layer.keys), list(layer.values)
    for h in range(layer.n_kv_heads):
        plain = keys[h].shape[1]
        slots = layer.head_slots(h).expand(1, -1)[0, layer.head_len(h) - plain :].long()
        inside = (slots >= start) & (slots < start + n)
        if not bool(inside.any()):
            continue
        at = slots[inside] - start
        ok_v = ~dv[h, at].isnan().any(-1)
        k_off = torch.zeros_like(keys[h][0], dtype=torch.float32)
        v_off = torch.zeros_like(k_off)
        k_off[inside] = torch.where(ok_v.unsqueeze(-1), dk[h, at].to(k_off.device), 0.0)
        v_off[inside] = torch.where(ok_v.unsqueeze(-1), dv[h, at].nan_to_num().to(v_off.device), 0.0)
        keys[h] = (keys[h].float() + k_off).to(keys[h].dtype)
        values[h] = (values[h].float() + v_off).to(values[h].dtype)
    layer.keys, layer.values = keys, values
