"""INT: plain per-token asymmetric quantization of keys and values, the baseline.

Each token's channels, in groups of `group`, share a float16 scale and zero (min-max); nothing
is kept in full precision unless `residual` says so (default 0, the plain baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.cache.encoded import Codec, Uniform
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import register


@register
@dataclass
class Int(Quantizer):
    """Per-token `bits`-bit codes for keys and values."""

    name = "int"
    paper = "baseline"
    bits: int = 4
    group: int = 32
    residual: int = field(default=0, kw_only=True)

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        return Uniform(self.bits, "token", self.group), Uniform(self.bits, "token", self.group)
