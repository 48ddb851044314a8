"""Quantile 1-bit codes (#11): group-specific levels placed at quantiles, not at min and max.

With one or two bits, min-max levels are wasted on outliers. Here each channel, over a group of
`group` tokens (the group-specific parameters), gets 2**bits levels at the quantiles
(i + 0.5) / 2**bits of its values (0.25 and 0.75 at one bit), and each value takes the nearest
level. Keys and values alike (the reference code quantizes both per channel).
Deviation: the paper's logit rescaling of visual tokens does not apply to text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.cache.encoded import META_DTYPE, Codec, Encoded, Where
from kvstack.cache.packing import pack, packed_size, unpack
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import register


def quantiles(chunks: torch.Tensor, n_levels: int) -> torch.Tensor:
    """(b, m, d, L) the (i + 0.5) / L quantiles of chunks (b, m, g, d) over its g tokens, linear
    interpolation between order statistics (torch.quantile's rule, without its size limit)."""
    ordered = chunks.sort(dim=2).values  # (b, m, g, d)
    g = chunks.shape[2]
    at = (torch.arange(n_levels, dtype=torch.float32, device=chunks.device) + 0.5) / n_levels * (g - 1)
    below, frac = at.floor().long(), at - at.floor()
    above = (below + 1).clamp(max=g - 1)
    low, high = ordered[:, :, below], ordered[:, :, above]  # (b, m, L, d)
    return (low + (high - low) * frac[:, None]).transpose(2, 3)


class QuantileCodec(Codec):
    """Per (token group, channel) levels at quantiles; codes index the nearest level."""

    def __init__(self, bits: int, group: int) -> None:
        self.bits, self.group, self.token_group = bits, group, group

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        b, n, d = x.shape
        g, n_levels = self.group, 2**self.bits
        pad = (-n) % g
        xp = torch.cat([x, x[:, -1:].expand(b, pad, d)], 1) if pad else x
        chunks = xp.float().reshape(b, -1, g, d)
        levels = quantiles(chunks, n_levels).to(META_DTYPE)  # (b, m, d, L)
        distance = (chunks.unsqueeze(-1) - levels.float().unsqueeze(2)).abs()  # (b, m, g, d, L)
        codes = distance.argmin(-1).reshape(b, -1, d)[:, :n]
        return Encoded(self, n, d, x.dtype, where, {"codes": pack(codes, self.bits)}, {"levels": levels}, {})

    def decode(self, enc: Encoded) -> torch.Tensor:
        codes = unpack(enc.tokens["codes"], self.bits, enc.dim).long()  # (b, n, d)
        levels = enc.per_token("levels")  # (b, n, d, L)
        return torch.gather(levels, -1, codes.unsqueeze(-1)).squeeze(-1).to(enc.dtype)

    def token_bytes(self, dim: int) -> float:
        return packed_size(dim, self.bits) + dim * 2**self.bits * META_DTYPE.itemsize / (0.75 * self.group)


@register
@dataclass
class Quantile(Quantizer):
    """`bits`-bit codes with quantile levels per channel and group of `group` tokens."""

    name = "quantile"
    paper = "#11"
    channel_groups = False
    bits: int = 1
    group: int = 64

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        return QuantileCodec(self.bits, self.group), QuantileCodec(self.bits, self.group)
