"""KIVI (Liu et al. 2024): keys quantized per channel, values per token, a residual in full precision.

Keys have a few channels with large magnitudes, so each channel gets its own scale and zero over
`group` consecutive tokens; values have no such channels and are quantized per token, channels
in groups of `group`. The newest `residual` tokens stay in full precision until a whole group of
keys can be quantized. Defaults from the paper: group 32, residual 128. Reference code read:
jy-yuan/KIVI (models/llama_kivi.py). Deviation: KIVI never evicts; in a stack, an eviction that
breaks a key group re-quantizes the survivors into fresh groups (one more rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.cache.encoded import Codec, Uniform
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import register


@register
@dataclass
class Kivi(Quantizer):
    """Keys per channel, values per token, at `bits` bits."""

    name = "kivi"
    paper = "KIVI"
    bits: int = 2
    group: int = 32

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        return Uniform(self.bits, "channel", self.group), Uniform(self.bits, "token", self.group)
