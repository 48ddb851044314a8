"""`cokv`: CoKV (Sun et al., 2025): heads' budgets from their Sliced Shapley values as a cooperative game."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.methods.allocate.calibrated import Calibrated
from kvstack.methods.registry import register


def cokv_weights(ssv: torch.Tensor, border: int = 1) -> torch.Tensor:
    """(L, h) budget weights from Sliced Shapley values (L, h): c = max(ssv - the `border`-th
    smallest value, 0), weight = c / mean(c); uniform when every c is 0."""
    flat = ssv.double().flatten()
    floor = torch.sort(flat).values[min(border, flat.numel()) - 1]
    c = (ssv.double() - floor).clamp(min=0)
    mean = c.mean()
    return c / mean if mean > 0 else torch.ones_like(c)


@register
@dataclass
class CoKV(Calibrated):
    """CoKV: heads "cooperate"; a head's importance is its contribution to the model's answers in
    every coalition of heads, its (Sliced) Shapley value, and heads get budget in proportion to
    it; the tokens are picked by `scorer` (SnapKV in the paper and here).

    Value of a coalition S of KV heads (`kvstack.calibrate.heads.cokv_ssv`, once per model): the
    heads of S keep their whole cache of a 256-id random context holding a random needle span,
    the others only their last 8 tokens (as nawei1010/CoKV cal_global_sv.py masks heads: budget
    0 plus window 8); v(S) is the mean log-probability of the needle's rest after its first 4
    ids, teacher-forced. Sliced Shapley values: for coalition sizes n/8, n/4, 3n/8, n/2 of the
    n = L x h_kv heads, `samples` (16) coalitions each, every head of S credited v(S) - v(N - S)
    and every other head the opposite (cal_global_sv.py's cc_left / cc_right); a head's value is
    the sum over sizes of its mean credit. Budget (the paper's allocation): c = max(ssv - the
    `border`-th (1st) smallest value, 0), weight = c / mean(c).

    Deviations: the paper values coalitions by task scores on LongBench samples; here by the
    log-probability of a copy task on random ids (no data, no tokenizer). Coalitions are taken
    as consecutive chunks of random permutations, so every head is in S about equally often.

    Shapes: calibration table (L, h_kv) Sliced Shapley values; weights (L, b, h_kv).
    """

    name = "cokv"
    paper = "CoKV: Optimizing KV Cache Allocation via Cooperative Game (arXiv 2502.17501)"
    samples: int = 16
    border: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples < 1:
            raise ValueError(f"cokv: samples must be >= 1 (coalitions per size), got {self.samples}")
        if self.border < 1:
            raise ValueError(f"cokv: border must be >= 1 (the k-th smallest value is the zero), got {self.border}")

    @property
    def kind(self) -> str:
        return f"cokv-v1-s{self.samples}"

    def measure(self, model: Any) -> torch.Tensor:
        from kvstack.calibrate.heads import cokv_ssv

        return cokv_ssv(model, self.samples)

    def head_weights(self, table: torch.Tensor) -> torch.Tensor:
        return cokv_weights(table, self.border)
