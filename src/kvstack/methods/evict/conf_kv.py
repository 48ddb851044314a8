"""`conf_kv`: CONF-KV (Li and Miao, arXiv 2605.24786): a confidence-driven per-step budget and a composite score.

No public code; we follow the abstract (a confidence from the next-token distribution picks the
per-step budget; tokens ranked by accumulated attention mass and recency; a protected recent
window) and flag every number we chose. The paper's FP16/INT8 storage and pyramidal variant are
not part of this scorer (a quantizer stage and `pyramid(conf_kv)` would play those roles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.methods.base import Method, Observation, recent_mask
from kvstack.methods.registry import register


@register
@dataclass
class ConfKV(Method):
    """When the model is confident in its next token it needs less context: CONF-KV holds fewer
    tokens than the budget on confident steps and the full budget on uncertain ones, and ranks
    tokens by a composite of attention mass and recency.

    Score (per KV head): lam * attention_sum / max(attention_sum) + (1 - lam) * position / newest
    position, both in [0, 1]; the first `sinks` tokens and the newest `protect` tokens score +inf.
    Per-step budget (`limit`): while decoding with confidence c (b,) in [0, 1] (1 = certain; the
    decoding loop computes it from the logits as 1 - normalised entropy, because `needs` names
    "confidence"), keep floor(keep * (floor_share + (1 - floor_share) * (1 - c))) tokens, never
    more than the budget's keep nor fewer than `min_tokens`; the prefill, and a step without a
    confidence (transformers' own `generate` computes none), keep the budget.

    Parameters and defaults, all guesses (the abstract gives no numbers): `lam` = 0.7, weight of
    attention against recency; `floor_share` = 0.5, the share of the budget a certain step still
    keeps; `sinks` = 4 (StreamingLLM's); `protect` = 16 newest tokens kept at prefill and decoding
    (the base class's decode_window). The linear map from confidence to budget and the
    normalisations (attention by its per-head max, position by the newest) are our reading.
    Every step (`every` = 1): the budget changes with each token's confidence.

    Shapes: attention_sum, positions (b, h, t) -> scores (b, h, t); keep (b, h), confidence (b,).
    """

    name = "conf_kv"
    family = "evict"
    paper = (
        "CONF-KV: Confidence-Aware KV Cache Eviction with Mixed-Precision Storage for Long-Horizon LLM "
        "(arXiv 2605.24786)"
    )
    needs = frozenset({"attention_sum", "confidence"})
    lam: float = 0.7
    floor_share: float = 0.5
    sinks: int = 4
    protect: int = 16
    every: int = field(default=1, kw_only=True)  # the budget follows each token's confidence

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"conf_kv: lam must be in [0, 1] (weight of attention vs recency), got {self.lam}")
        if not 0.0 <= self.floor_share <= 1.0:
            raise ValueError(f"conf_kv: floor_share must be in [0, 1] (kept when certain), got {self.floor_share}")
        if self.sinks < 0 or self.protect < 0:
            raise ValueError(f"conf_kv: sinks and protect must be >= 0, got sinks={self.sinks}, protect={self.protect}")

    @property
    def min_tokens(self) -> int:
        return self.sinks + 1

    def score(self, obs: Observation) -> torch.Tensor:
        scores = composite_score(obs.attention_sum, obs.positions, obs.valid, self.lam)
        kept = (obs.valid & (obs.positions < self.sinks)) | recent_mask(obs, self.protect)
        return torch.where(kept, torch.full_like(scores, float("inf")), scores)

    def limit(self, keep: torch.Tensor, decoding: bool, confidence: torch.Tensor | None) -> torch.Tensor:
        if not decoding or confidence is None:
            return keep
        return confident_keep(keep, confidence, self.floor_share, self.min_tokens)

    def step_done(self, cache: Any, logits: torch.Tensor) -> None:
        cache.confidence = confidence(logits)


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """(b,) 1 - normalised entropy of the next-token distribution for logits (b, vocab): 1 = certain."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return (1.0 - entropy / torch.log(torch.tensor(float(logits.shape[-1])))).clamp(0.0, 1.0)


def composite_score(attention_sum: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, lam: float) -> torch.Tensor:
    """(b, h, t) lam * attention / its per-head max + (1 - lam) * position / the newest position.

    attention_sum, pos, valid: (b, h, t); padding contributes to neither maximum.
    """
    tiny = torch.finfo(torch.float32).tiny
    attention = torch.where(valid, attention_sum.float(), torch.zeros_like(attention_sum, dtype=torch.float32))
    mass = attention / attention.amax(-1, keepdim=True).clamp(min=tiny)
    position = torch.where(valid, pos, torch.zeros_like(pos)).float()
    recency = position / position.amax(-1, keepdim=True).clamp(min=1.0)
    return lam * mass + (1.0 - lam) * recency


def confident_keep(keep: torch.Tensor, confidence: torch.Tensor, floor_share: float, least: int) -> torch.Tensor:
    """(b, h) floor(keep * (floor_share + (1 - floor_share) * (1 - c))), within [min(keep, least), keep].

    keep (b, h) long; confidence (b,) in [0, 1]. The share is rounded to 1e-9 first, so that a share of
    exactly 1 is not lost to float error (floor(0.999...) would drop a token at c = 0).
    """
    c = confidence.to(torch.float64).clamp(0.0, 1.0)
    share = floor_share + (1.0 - floor_share) * (1.0 - c)
    share = torch.round(share * 1e9) / 1e9
    fewer = torch.floor(keep.to(torch.float64) * share.unsqueeze(-1)).long()
    return torch.minimum(torch.maximum(fewer, keep.clamp(max=least)), keep)
