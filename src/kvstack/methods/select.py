"""Turn scores into a decision: which held tokens each head keeps. Pure functions."""

from __future__ import annotations

import torch

from kvstack.cache.keep import Keep


def select(
    scores: torch.Tensor,
    valid: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    protected: torch.Tensor | None = None,
) -> Keep:
    """Keep the `keep[b, h]` highest-scoring valid tokens of each head, protected ones first.

    scores, valid, slots: (b, h, t); keep: (b, h); protected: (b, h, t) or None.
    """
    n_valid = valid.sum(-1)
    count = torch.minimum(keep, n_valid)
    k = int(count.max().item()) if count.numel() else 0
    s = scores.float().masked_fill(~valid, float("-inf"))
    s = torch.nan_to_num(s, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    if protected is not None:
        s = torch.where(protected & valid, torch.full_like(s, float("inf")), s)
    # a stable sort breaks ties by slot order, the same for a sequence alone or in a batch
    top = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]  # (b, h, k), best first
    real = torch.arange(k, device=scores.device) < count.unsqueeze(-1)
    order_key = torch.where(real, torch.gather(slots, -1, top), torch.full_like(top, torch.iinfo(torch.long).max))
    order = torch.argsort(order_key, dim=-1, stable=True)
    return Keep(index=torch.gather(top, -1, order), count=count)
