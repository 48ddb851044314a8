"""`dar`: Distance-Adaptive Representation (#62): full dimension near the query, fewer far away.

The newest `residual` tokens (the local window, 128 by default) keep their full keys and
values; older tokens keep `fraction` of the dimensions (1/4 by default, the paper's setting),
as coefficients on each head's top principal axes fitted on calibration text (`pca`'s table).
Keys post-RoPE, as the cache holds them. Deviation: the paper trains the reduced projections
with the model; a training-free toolkit fits them by PCA instead (what the issue asks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.cache.encoded import Codec
from kvstack.methods.lowrank.base import Projector, fitted_axes, projections
from kvstack.methods.registry import register


@register
@dataclass
class Dar(Projector):
    """`fraction` of head_dim kept beyond the local window of `residual` tokens."""

    name = "dar"
    paper = "#62"
    fraction: float = 0.25
    samples: int = 4
    tokens: int = 512
    residual: int = field(default=128, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"dar: fraction must be in (0, 1] (dimensions kept far away), got {self.fraction}")

    def ranks(self, head_dim: int) -> tuple[int, int]:
        rank = max(1, round(self.fraction * head_dim))
        return rank, rank

    def prepare(self, model: Any) -> torch.Tensor:
        return fitted_axes(model, self.samples, self.tokens)

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        assert table is not None, "dar needs its fitted axes (prepare)"
        return projections(table, *self.ranks(table.shape[-1]))
