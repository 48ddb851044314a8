"""`headkv`: HeadKV-R2 (Fu et al., 2024): each head's budget follows its retrieval score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.methods.allocate.calibrated import Calibrated
from kvstack.methods.registry import register


def headkv_weights(scores: torch.Tensor, beta: float, temp: float = 1.0) -> torch.Tensor:
    """(L, h) budget weights from head scores (L, h): every head keeps B (1 - 1 / beta) of a uniform
    budget B; a pool of B / beta per head goes out in proportion to p = s^temp / sum(s^temp):
    cap = p x pool + B (1 - 1 / beta) with pool = (B / beta) L h, so weight = cap / B =
    p L h / beta + 1 - 1 / beta (mean 1). All-zero scores: uniform."""
    s = scores.double().clamp(min=0) ** temp
    total = s.sum()
    p = s / total if total > 0 else torch.full_like(s, 1.0 / s.numel())
    return p * s.numel() / beta + (1.0 - 1.0 / beta)


@register
@dataclass
class HeadKV(Calibrated):
    """HeadKV: "not all heads are equally important"; heads that retrieve and reason over the
    context get more of the budget. Each KV head's share follows a retrieval score measured once
    per model (`kvstack.calibrate.heads.headkv_scores`); its tokens are picked by `scorer`
    (SnapKV in the paper and here).

    Score (retrieval-reasoning head detection, FYYFU/HeadKV retrieval_head_detection_r2.py): while
    the model produces a needle, a head's top-k attended positions (k = needle length) that fall
    inside the needle in the context add their attention / k; mean over answer tokens and
    examples; a KV head takes the mean of its query group. Budget (headkv/snapkv_utils.py
    ReasonSnapKVCluster, README): `headkv_weights` with `beta` 1.5 (the README sweeps 1.005 to 10)
    and `temp` 1 (exponent on the scores, 1 throughout the README).

    Deviation: the paper's needles are reasoning questions over natural text, kept only when the
    model answers them (F1 > 0.5); small models fail that filter, so here the needle is a random
    id span in a random-id haystack, recalled by copying (its first 4 ids given, the rest
    teacher-forced), at depths 0.25, 0.5 and 0.75.

    Shapes: calibration table (L, h_kv) scores summing to 1; weights (L, b, h_kv).
    """

    name = "headkv"
    paper = "Not All Heads Matter: A Head-Level KV Cache Compression Method (HeadKV, arXiv 2410.19258)"
    beta: float = 1.5
    temp: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"headkv: beta must be >= 1 (each head keeps budget x (1 - 1/beta)), got {self.beta}")
        if self.temp <= 0:
            raise ValueError(f"headkv: temp must be > 0 (exponent on the head scores), got {self.temp}")

    def measure(self, model: Any) -> torch.Tensor:
        from kvstack.calibrate.heads import headkv_scores

        return headkv_scores(model)

    def head_weights(self, table: torch.Tensor) -> torch.Tensor:
        return headkv_weights(table, self.beta, self.temp)
