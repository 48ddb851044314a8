"""`pca`: keys and values projected on their top-r principal axes (the training-free baseline of
MatryoshkaKV, #33).

Per layer and KV head, the axes are the eigenvectors of the covariance of keys (post-RoPE) and
values the model produces on calibration text (State of the Union prose; random tokens for a
model without a tokenizer), fitted once per model and saved. A token is stored as r
coefficients in the model's dtype; the axes (r, d) and the mean (d,) per head are counted.
At r = head_dim the projection is a rotation and reproduces the cache to float rounding.
Deviation: MatryoshkaKV then trains the projections by distillation; this is its PCA baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.cache.encoded import Codec
from kvstack.methods.lowrank.base import Projector, fitted_axes, projections
from kvstack.methods.registry import register


@register
@dataclass
class Pca(Projector):
    """r dimensions kept for keys and values (`k`, `v` override each); fitted on `samples` rows
    of `tokens` calibration tokens."""

    name = "pca"
    paper = "#33"
    r: int = 32
    k: int = 0
    v: int = 0
    samples: int = 4
    tokens: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples < 1 or self.tokens < 2:
            raise ValueError(f"{self.name}: fit on samples >= 1 rows of tokens >= 2 tokens")

    def ranks(self, head_dim: int) -> tuple[int, int]:
        return self.k or self.r, self.v or self.r

    def prepare(self, model: Any) -> torch.Tensor:
        return fitted_axes(model, self.samples, self.tokens)

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        assert table is not None, "pca needs its fitted axes (prepare)"
        return projections(table, *self.ranks(table.shape[-1]))
