"""The Lagrangian: spend one byte budget over every layer and head where it lowers distortion most.

Each head picks an option (a storage and a byte share of its full bytes; the share sets how many
tokens it keeps, as the cache's `tokens_to_keep` counts them) minimising distortion + lambda x
bytes; each layer picks the scorer whose heads' sum is lowest; lambda is bisected until the
bytes fit. Pure functions on tensors: the decision is plain data the cache executes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstack.cache.budget import Budget, Cost, tokens_to_keep

SHARES = tuple(2 ** (-k / 4) for k in range(41))  # a head's byte share of its full bytes: 1 down to 1/1024
SHARE_RANGE = (1e-12, 1.0 - 1e-9)  # a share as a fraction budget: below 1 (see `share_budget`)


@dataclass(frozen=True)
class Choice:
    """Per layer the scorer (L,); per layer and head the storage (L, h), the byte share (L, h)
    and the tokens it keeps now (L, h)."""

    scorer: torch.Tensor
    storage: torch.Tensor
    share: torch.Tensor
    tokens: torch.Tensor


def interpolate(curve: torch.Tensor, fractions: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear in log fraction: curve (..., F) measured at `fractions` (F,), descending,
    read at `at` (..., K) with the same leading shape; returns (..., K).
    Outside the measured range the nearest end is used."""
    logf = fractions.double().log().flip(0)  # ascending
    y = curve.double().flip(-1)
    x = at.double().clamp(min=float(fractions.min()), max=float(fractions.max())).log()
    right = torch.searchsorted(logf, x.contiguous()).clamp(1, len(logf) - 1)
    left = right - 1
    x0, x1 = logf[left], logf[right]
    y0, y1 = torch.gather(y, -1, left), torch.gather(y, -1, right)
    w = ((x - x0) / (x1 - x0)).clamp(0, 1)
    return y0 + w * (y1 - y0)


def share_budget(share: float) -> Budget:
    """A head's byte share as a fraction budget, kept below 1 so a head that evicts nothing still
    pays for the slots its layer's evictions make explicit (a 1.0 budget would keep everything)."""
    return Budget(fraction=min(max(share, SHARE_RANGE[0]), SHARE_RANGE[1]))


def option_tokens(n: torch.Tensor, costs: list[Cost], least: int) -> torch.Tensor:
    """(L, Q, P) tokens a head of each layer keeps with n (L,) tokens, storage q and share `SHARES[p]`
    (at least `least`, never more than it holds)."""
    out = torch.zeros(len(n), len(costs), len(SHARES), dtype=torch.long)
    for q, cost in enumerate(costs):
        for p, share in enumerate(SHARES):
            out[:, q, p] = tokens_to_keep(share_budget(share), n, cost)
    return torch.maximum(out, torch.clamp(n, max=least)[:, None, None])


def solve(
    distortion: torch.Tensor,
    fractions: torch.Tensor,
    n: torch.Tensor,
    costs: list[Cost],
    budget_bytes: float,
    least: int,
    floor: torch.Tensor,
) -> Choice:
    """The cheapest distortion within `budget_bytes` (per sequence): distortion (S, L, H, Q, F)
    measured at `fractions` (F,), n (L,) tokens each head of a layer holds, costs (Q,) per storage.
    A head's bytes are its share of its full bytes (what the cache allows it at every step), at
    least its layer's `floor` (L,) (`least` plain tokens, a part of a uniform split). After the
    bisection, heads are upgraded greedily into the bytes it left (best distortion saved per byte
    first, at most 4 moves per head)."""
    S, L, H, Q, _ = distortion.shape
    tokens = option_tokens(n, costs, least)  # (L, Q, P)
    kept = tokens.double() / n.clamp(min=1).double()[:, None, None]
    d = interpolate(distortion, fractions, kept[None, :, None].expand(S, L, H, Q, len(SHARES)))
    full = torch.tensor([c.full for c in costs], dtype=torch.float64)[0]
    share = torch.tensor(SHARES, dtype=torch.float64)
    spend = torch.maximum(share[None, None, :], floor.double()[:, None, None]) * n.double()[:, None, None] * full
    spend = spend.expand(L, Q, len(SHARES)) / budget_bytes  # in budgets

    def pick(lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        cost = d + lam * spend[None, :, None]  # (S, L, H, Q, P)
        best, flat = cost.flatten(-2).min(-1)  # (S, L, H)
        scorer = best.sum(-1).argmin(0)  # (L,)
        chosen = flat[scorer, torch.arange(L)]  # (L, H)
        used = torch.gather(spend.flatten(-2).expand(L, Q * len(SHARES)), 1, chosen).sum()
        return scorer, chosen // len(SHARES), chosen % len(SHARES), float(used)

    lo, hi = -12.0, 8.0  # log10 lambda
    if pick(10**hi)[3] > 1 + 1e-9:
        hi = math.inf
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            if pick(10**mid)[3] <= 1 + 1e-9:
                hi = mid
            else:
                lo = mid
    scorer, storage, p = pick(10**hi if math.isfinite(hi) else 1e12)[:3]
    storage, p = fill(d[scorer, torch.arange(L)], spend, storage, p)
    return Choice(scorer, storage, share[p].float(), tokens[torch.arange(L)[:, None], storage, p])


def fill(
    d: torch.Tensor, spend: torch.Tensor, storage: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spend what a Lagrangian choice left under 1 budget: repeatedly move the one head whose
    move to a costlier option saves the most distortion per extra byte, while it fits.
    d (L, H, Q, P) distortion, spend (L, Q, P) in budgets, storage and p (L, H) the choice."""
    L, H, Q, P = d.shape
    flat_spend = spend.flatten(-2)[:, None, :].expand(L, H, Q * P)
    flat_d = d.flatten(-2)
    for _ in range(4 * L * H):
        now = (storage * P + p).unsqueeze(-1)  # (L, H, 1)
        used = float(torch.gather(flat_spend, -1, now).sum())
        extra = flat_spend - torch.gather(flat_spend, -1, now)
        saved = torch.gather(flat_d, -1, now) - flat_d
        gain = torch.where(
            (extra > 0) & (saved > 0) & (extra <= 1 - used + 1e-12), saved / extra, torch.zeros_like(extra)
        )
        if not bool((gain > 0).any()):
            break
        best = int(gain.flatten().argmax())
        head, option = divmod(best, Q * P)
        i, h = divmod(head, H)
        storage, p = storage.clone(), p.clone()
        storage[i, h], p[i, h] = option // P, option % P
    return storage, p
