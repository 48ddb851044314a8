"""RazorAttention's compensation token: per head, one entry that averages the tokens its
eviction dropped, kept among the head's tokens so attention still sees their mean."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstack.cache.layer import SLOT_DTYPE

if TYPE_CHECKING:
    from kvstack.cache.layer import CompressedLayer


def fold(
    layer: CompressedLayer, dropped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
) -> None:
    """Average the tokens just evicted into each head's compensation token (RazorAttention).

    dropped (b, h, t): the evicted tokens in the dense view taken before `apply`; keys, values
    (b, h, t, d) and slots (b, h, t) that view. A head without a compensation token gets one at
    its first evicted slot; one that has it updates the running mean (count-weighted). The
    token is an ordinary entry for attention (the reference code gives it no extra weight).
    Call after `apply`, which must have kept the existing compensation tokens.
    """
    if layer.is_coded:
        raise NotImplementedError("a compensation token over encoded tokens is not supported")
    b, h = dropped.shape[:2]
    device = dropped.device
    if layer.comp_slot is None or layer.comp_count is None:
        layer.comp_slot = torch.full((b, h), -1, dtype=torch.long, device=device)
        layer.comp_count = torch.zeros(b, h, dtype=torch.float32, device=device)
    n_new = dropped.sum(-1).float()  # (b, h)
    if not bool((n_new > 0).any()):
        return
    weight = dropped.float().unsqueeze(-1)
    sum_k, sum_v = (keys.float() * weight).sum(2), (values.float() * weight).sum(2)  # (b, h, d)
    first = torch.where(dropped, slots, torch.full_like(slots, torch.iinfo(torch.long).max)).amin(-1)
    assert layer.slots is not None
    # a token a sliding window has since dropped is gone: its head starts a new one
    has = torch.stack(
        [
            ((layer.slots[hh].long() == layer.comp_slot[:, hh : hh + 1]) & (layer.comp_slot[:, hh : hh + 1] >= 0)).any(
                1
            )
            for hh in range(h)
        ],
        dim=1,
    )  # (b, h)
    layer.comp_count = torch.where(has, layer.comp_count, torch.zeros_like(layer.comp_count))
    slot = torch.where(has, layer.comp_slot, first)
    for hh in range(h):
        rows = n_new[:, hh] > 0
        if not bool(rows.any()):
            continue
        k_h, v_h, s_h = layer.keys[hh], layer.values[hh], layer.slots[hh].long()
        at = (s_h == slot[:, hh : hh + 1]) & has[:, hh : hh + 1]  # (b, t_h) the existing token
        old_k = (k_h.float() * at.unsqueeze(-1)).sum(1)
        old_v = (v_h.float() * at.unsqueeze(-1)).sum(1)
        n_old = layer.comp_count[:, hh]
        total = (n_old + n_new[:, hh]).clamp(min=1).unsqueeze(-1)
        new_k = ((old_k * n_old.unsqueeze(-1) + sum_k[:, hh]) / total).to(k_h.dtype)
        new_v = ((old_v * n_old.unsqueeze(-1) + sum_v[:, hh]) / total).to(v_h.dtype)
        insert = rows & ~has[:, hh]
        if bool(insert.any()):  # one more entry, placed in slot order (empty where not inserted)
            k_h = torch.cat([k_h, new_k.unsqueeze(1)], dim=1)
            v_h = torch.cat([v_h, new_v.unsqueeze(1)], dim=1)
            s_h = torch.cat([s_h, torch.where(insert, slot[:, hh], -1).unsqueeze(1)], dim=1)
            at = torch.cat([at, insert.unsqueeze(1)], dim=1)
            order = torch.argsort(torch.where(s_h < 0, torch.iinfo(torch.long).max, s_h), dim=1, stable=True)
            k_h = torch.gather(k_h, 1, order.unsqueeze(-1).expand_as(k_h))
            v_h = torch.gather(v_h, 1, order.unsqueeze(-1).expand_as(v_h))
            at, s_h = torch.gather(at, 1, order), torch.gather(s_h, 1, order)
            for per_head in layer.stats.values():
                x = torch.cat([per_head[hh], per_head[hh].new_zeros(b, 1)], dim=1)
                per_head[hh] = torch.gather(x, 1, order)
        update = at & rows.unsqueeze(1)
        layer.keys = layer.keys.with_head(hh, torch.where(update.unsqueeze(-1), new_k.unsqueeze(1), k_h))
        layer.values = layer.values.with_head(hh, torch.where(update.unsqueeze(-1), new_v.unsqueeze(1), v_h))
        layer.slots[hh] = s_h.to(SLOT_DTYPE)
    layer.comp_count = torch.where(n_new > 0, layer.comp_count + n_new, layer.comp_count)
    layer.comp_slot = torch.where(n_new > 0, slot, torch.where(has, layer.comp_slot, -1))


def compensation_mask(layer: CompressedLayer, slots: torch.Tensor) -> torch.Tensor:
    """(b, h, t) True where the dense view holds a head's compensation token."""
    if layer.comp_slot is None:
        return torch.zeros_like(slots, dtype=torch.bool)
    return (slots == layer.comp_slot.unsqueeze(-1)) & (layer.comp_slot.unsqueeze(-1) >= 0)
