"""KV-AdaQuant (#6, "Quantize What Counts"): more bits to keys than to values at the same total.

Key matrices have larger spectral and Frobenius norms than value matrices, so their
quantization error costs more: at the same mean bit width, K4V2 beats K2V4 (the paper: 75.2%
vs 54.7%). The layout is KIVI's (keys per channel, values per token); `k` and `v` are the bit
widths. Defaults from the reference code (mohsenhariri/spectral-kv): k=4, v=2, residual 128;
group 32 here (64 there) so that groups divide a 64-wide head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.cache.encoded import Codec, Uniform
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import register


@register
@dataclass
class AdaQuant(Quantizer):
    """Keys at `k` bits per channel, values at `v` bits per token."""

    name = "adaquant"
    paper = "#6"
    k: int = 4
    v: int = 2
    group: int = 32

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        return Uniform(self.k, "channel", self.group), Uniform(self.v, "token", self.group)
