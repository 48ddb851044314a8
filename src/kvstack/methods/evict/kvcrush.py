"""`kvcrush`: KVCrush (Jha et al., arXiv 2503.00022): keep the most important tokens plus a few
representatives of the rest, picked by a cheap binary head signature."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Method, Observation
from kvstack.methods.evict.rescore import Rescorer
from kvstack.methods.registry import register

ANCHORS = ("alternate", "mean", "inv_mean")


def descending_rank(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(b, h, t) rank of each valid token by scores (b, h, t), 0 = best; ties by index; padding last."""
    order = torch.sort(scores.masked_fill(~valid, float("-inf")), dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter(-1, order, ranks)


def head_signature(top: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, n_slots: int) -> torch.Tensor:
    """(b, h, t, h) bits of each held token: bit j = the token is in head j's top half.

    top, slots, valid: (b, h, t). Heads may hold different tokens, so bits meet by logical slot;
    a token a head no longer holds has bit 0 there."""
    b, h, t = slots.shape
    where = (slots.clamp(min=0) * h + torch.arange(h, device=slots.device).view(1, h, 1)).reshape(b, h * t)
    table = torch.zeros(b, n_slots * h, device=slots.device).scatter_add(1, where, (top & valid).float().reshape(b, -1))
    rows = slots.clamp(min=0).reshape(b, h * t, 1).expand(-1, -1, h)
    return torch.gather(table.view(b, n_slots, h), 1, rows).reshape(b, h, t, h)


def anchor_point(signature: torch.Tensor, valid: torch.Tensor, mode: str) -> torch.Tensor:
    """(b, h, 1, h) the anchor bits: alternating 0101..., or the (inverted) majority bit of each
    head's held tokens. signature: (b, h, t, h); valid: (b, h, t)."""
    if mode == "alternate":
        return (torch.arange(signature.shape[-1], device=signature.device) % 2).float().view(1, 1, 1, -1)
    weights = valid.float().unsqueeze(-1)
    mean = (signature * weights).sum(2, keepdim=True) / weights.sum(2, keepdim=True).clamp(min=1)
    return (mean > 0.5).float() if mode == "mean" else (mean < 0.5).float()


def spread_picks(distance: torch.Tensor, eligible: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(b, h, t) True for `count` (b, h) eligible tokens evenly spaced along the eligible tokens
    sorted by distance (b, h, t), stable: positions floor(j * (n - 1) / (count - 1)), j < count."""
    n = eligible.sum(-1)  # (b, h)
    count = torch.minimum(count, n)
    order = torch.sort(distance.float().masked_fill(~eligible, float("inf")), dim=-1, stable=True).indices
    j = torch.arange(distance.shape[-1], device=distance.device).view(1, 1, -1)
    step = (n - 1).clamp(min=0).double() / (count - 1).clamp(min=1).double()  # (b, h)
    at = torch.floor(j * step.unsqueeze(-1) + 1e-9).long().clamp(max=distance.shape[-1] - 1)
    real = j < count.unsqueeze(-1)
    picked = torch.gather(order, -1, at)
    return torch.zeros_like(eligible).scatter(-1, picked, real) & eligible


@register
@dataclass
class KVCrush(Rescorer):
    """KVCrush splits each head's budget: most of it to the inner scorer's top tokens, a share
    `ratio` to representatives of the tokens it would evict. Each token gets a binary signature,
    one bit per KV head of the layer (in that head's top half of the inner scores among valid
    tokens), shared by all heads; tokens are sorted by the Hamming distance of their signature to
    an anchor (alternating 0101... by default), and representatives are taken evenly spaced along
    that order from the tokens the importance part did not choose (a cheap clustering). The
    reference code works on pages of 16 tokens; here a page is one token, and the representatives
    are chosen per head (the vLLM code shares head 0's). Scores express the choice: importance
    picks 2t + v, representatives t + v, the rest v, with v = t - rank in the inner scores, so
    select keeps exactly those and a smaller budget drops representatives first; the inner's +inf
    tokens stay +inf.

    Parameters (reference: the vLLM fork's vllm/v1/attention/backends/kvcrush.py H2OKVCrushCluster,
    kvcrush_ratio=0.25, anchor_mode="alternate"; OpenVINO GenAI src/cpp/src/continuous_batching/
    kvcrush.cpp): `scorer` the importance scorer, default snapkv; `ratio` in [0, 1), default 0.25,
    share of each head's keep (`obs.keep`, (b, h)) given to representatives; `anchor` one of
    alternate, mean, inv_mean.

    Shapes: inner scores (b, h, t) -> signatures (b, h, t, h) -> scores (b, h, t).
    """

    name = "kvcrush"
    family = "evict"
    paper = "KVCrush: Key Value Cache Size-Reduction Using Similarity in Head-Behaviour (arXiv 2503.00022)"
    scorer: Method = field(default_factory=lambda: default_scorer("snapkv"))
    ratio: float = 0.25
    anchor: str = "alternate"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"kvcrush: ratio must be in [0, 1) (budget share of representatives), got {self.ratio}")
        if self.anchor not in ANCHORS:
            raise ValueError(f"kvcrush: anchor must be one of {', '.join(ANCHORS)}, got {self.anchor!r}")

    def score(self, obs: Observation) -> torch.Tensor:
        inner = self.scorer.score(obs).float()
        valid, t = obs.valid, inner.shape[-1]
        rank = descending_rank(inner, valid)  # (b, h, t)
        n_rep = torch.floor(obs.keep.double() * self.ratio).long()  # (b, h)
        important = valid & (rank < (obs.keep - n_rep).unsqueeze(-1))
        top_half = rank < (valid.sum(-1) // 2).unsqueeze(-1)
        signature = head_signature(top_half, obs.slots, valid, int(obs.slots.max().clamp(min=0)) + 1)
        distance = (signature != anchor_point(signature, valid, self.anchor)).sum(-1)  # (b, h, t)
        chosen = spread_picks(distance, valid & ~important, n_rep)
        value = (t - rank).float()
        scores = value + t * (chosen.float() + 2 * important.float())
        return torch.where(torch.isposinf(inner), inner, scores)
