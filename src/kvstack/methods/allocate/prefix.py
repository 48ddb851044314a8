"""`prefix`: PrefixKV (Wang et al., 2024): one global prefix of the importance distribution for every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.methods.allocate.base import Allocator, Plan
from kvstack.methods.registry import register

SEARCH_STEPS = 60  # bisection steps on the mass threshold: far below a token's mass for any real prompt


def token_importance(
    scores: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, S) each token's score averaged over the heads holding it, and (b, S) True where any does.

    scores, valid, slots: (b, h, t) one layer's dense views (heads may hold different tokens, so
    tokens are matched by slot). +inf (must keep) counts as the layer's largest finite score.
    """
    s = scores.double()
    finite = torch.isfinite(s) & valid
    top = torch.where(finite, s, torch.full_like(s, float("-inf"))).amax(dim=(1, 2), keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    s = torch.where(s == float("inf"), top.expand_as(s), s)
    s = torch.where(valid, s.nan_to_num(0.0, neginf=0.0), torch.zeros_like(s))
    b = s.shape[0]
    n_slots = int(slots.max()) + 1 if slots.numel() else 0
    index = torch.where(valid, slots, torch.zeros_like(slots)).long().reshape(b, -1)
    total = torch.zeros(b, n_slots, dtype=s.dtype, device=s.device).scatter_add_(1, index, s.reshape(b, -1))
    heads = torch.zeros_like(total).scatter_add_(1, index, valid.reshape(b, -1).to(s.dtype))
    return total / heads.clamp(min=1), heads > 0


def importance_cdf(importance: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(b, t) cumulative share of one layer's importance (b, t) over its real tokens (b, t),
    most important first. Negative scores are shifted to start at 0; an all-zero row counts
    as flat. Entries from the last real token on are exactly 1.
    """
    token = importance.double().masked_fill(~real, 0.0)
    low = torch.where(real, token, torch.full_like(token, float("inf"))).amin(-1, keepdim=True)
    token = torch.where(real & (low < 0), token - low, token)
    flat = token.sum(-1, keepdim=True) <= 0
    token = torch.where(flat & real, torch.ones_like(token), token)
    ordered = torch.sort(token.masked_fill(~real, float("-inf")), dim=-1, descending=True).values.clamp(min=0)
    cdf = ordered.cumsum(-1) / ordered.sum(-1, keepdim=True).clamp(min=1e-300)
    rank = torch.arange(cdf.shape[-1], device=cdf.device)
    return torch.where(rank >= real.sum(-1, keepdim=True) - 1, torch.ones_like(cdf), cdf)


def tokens_for_mass(cdfs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """(L, b) tokens each layer needs to reach `mass` (b,) of its importance; cdfs (L, b, t)."""
    L, b, _ = cdfs.shape
    m = mass.to(cdfs.dtype).view(1, b, 1).expand(L, b, 1).contiguous()
    return torch.searchsorted(cdfs.contiguous(), m).squeeze(-1) + 1


def prefix_counts(cdfs: torch.Tensor, total: torch.Tensor | int) -> torch.Tensor:
    """(L, b) tokens per layer: one mass threshold m per sequence, shared by all layers, such that
    the tokens each layer needs to reach m (`searchsorted(cdf, m) + 1`) add up to `total` (b,).

    cdfs: (L, b, t) from `importance_cdf`. The total is a step function of m, so the threshold
    is bisected on [0, 1] and the side closer to `total` wins (the lower one on a tie).
    """
    L, b, _ = cdfs.shape
    target = torch.as_tensor(total, device=cdfs.device).expand(b).long()
    lo = torch.zeros(b, dtype=cdfs.dtype, device=cdfs.device)
    hi = torch.ones(b, dtype=cdfs.dtype, device=cdfs.device)
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        enough = tokens_for_mass(cdfs, mid).sum(0) >= target
        hi, lo = torch.where(enough, mid, hi), torch.where(enough, lo, mid)
    below, above = tokens_for_mass(cdfs, lo), tokens_for_mass(cdfs, hi)
    closer = (target - below.sum(0)).abs() <= (above.sum(0) - target).abs()
    return torch.where(closer, below, above)


@register
@dataclass
class Prefix(Allocator):
    """Layers differ in how concentrated their importance is, so every layer keeps the shortest
    prefix of its own tokens (most important first) holding the same share of its importance;
    that share is one global threshold, searched so the total matches a uniform split
    (PrefixKV's "global prefix configuration", `obtain_cdf_num` in THU-MIG/PrefixKV prefixkv.py).
    A peaked layer reaches the threshold with few tokens and gives the rest to flatter layers.

    Importance per token: the scorer's scores (default snapkv) averaged over the layer's heads;
    the paper uses the prompt's accumulated attention instead (`prefix(h2o)` is closest: its
    recent window counts at the top score). The paper searches the threshold offline on sample
    prompts and reuses the ratios; here it is searched per prompt and per batch row, no
    calibration. No parameters beyond the scorer.

    Shapes: scores (b, h, t) per layer -> cdfs (L, b, t) -> counts (L, b) -> weights (L, b, h).
    """

    name = "prefix"
    paper = (
        "PrefixKV: Adaptive Prefix KV Cache is What Vision Instruction-Following Models Need for Efficient "
        "Generation (arXiv 2412.03409)"
    )
    whole_prompt: ClassVar[bool] = True

    def weights(self, plan: Plan) -> torch.Tensor:
        L, b, h = plan.shape
        cdfs = []
        for layer_idx in range(L):
            obs = plan.observation(layer_idx)
            cdfs.append(importance_cdf(*token_importance(plan.scores(layer_idx), obs.valid, obs.slots)))
        t = max(c.shape[-1] for c in cdfs)
        padded = torch.stack([torch.nn.functional.pad(c, (0, t - c.shape[-1]), value=1.0) for c in cdfs])
        base = plan.base.to(padded.device)
        counts = prefix_counts(padded, base.sum(0))
        w = torch.where(base > 0, counts.double() / base.clamp(min=1).double(), torch.zeros_like(counts.double()))
        return w[:, :, None].expand(L, b, h)
