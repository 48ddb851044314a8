"""The quantization interface: a stage that decides how held tokens are stored, not which.

A `Quantizer` gives the cache two codecs (keys, values). The cache keeps the newest
`residual` tokens of each head in the model's dtype and, once more arrive, encodes the oldest
into packed codes (`KVCache.encode`); attention decodes one head at a time. Stacked after an
eviction stage (`snapkv+kivi(bits=2)`) it changes what a token costs, so the same byte budget
keeps more tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from kvstack.cache.encoded import META_DTYPE, Codec, Encoded, Where
from kvstack.cache.packing import check_bits
from kvstack.errors import UserError
from kvstack.methods.base import Stage


@dataclass
class Quantizer(Stage):
    """Base of every quantization stage: `codecs()` (keys, values), a residual window in the
    model's dtype, and optionally a calibration (`prepare`) and observed queries."""

    family: ClassVar[str] = "quantize"
    role: ClassVar[str] = "storer"
    residual: int = field(default=128, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("bits", "k", "v", "hi", "lo"):
            if isinstance(getattr(self, name, None), int):
                check_bits(getattr(self, name), self.name)
        if self.residual < 0:
            raise ValueError(f"{self.name}: residual must be >= 0 (newest tokens kept in full precision)")

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        """The key codec and the value codec (`table`: what `prepare` measured, if anything)."""
        raise NotImplementedError

    def check(self, head_dim: int) -> None:
        """One-line error when a group size does not divide the model's head dimension."""
        group = getattr(self, "group", None)
        if isinstance(group, int) and (group < 1 or (head_dim % group and self.channel_groups)):
            fit = max((g for g in range(1, min(max(group, 1), head_dim) + 1) if head_dim % g == 0), default=1)
            raise UserError(
                f"{self.name}: group={group} does not divide head_dim={head_dim}: use {self.name}(group={fit})"
            )

    channel_groups: ClassVar[bool] = True  # does `group` split a token's channels (must divide head_dim)

    @property
    def query_window(self) -> int:
        """Recent queries the cache keeps for this stage (0 = none)."""
        return 0

    def prepare(self, model: Any) -> torch.Tensor | None:
        """Calibrate on the model once (codebooks), or None when nothing is needed."""
        return None

    @property
    def rows_alike(self) -> bool:
        """True when `encode` codes every token of a head alike, at one precision, reading nothing
        of the head but its tokens: the cache may then encode several heads' rows in one call."""
        return type(self).encode is Quantizer.encode

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, where: Where, codecs: tuple[Codec, Codec], layer: Any
    ) -> list[tuple[Encoded, Encoded, torch.Tensor]]:
        """Encode one head's oldest tokens, keys and values (b, n, d) with `codecs` (from `codecs`):
        a list of (keys, values, positions (n_i,) of the tokens among the n), one per precision
        (most methods: one, all positions). `layer` is the CompressedLayer, for methods that
        weigh tokens by attention (QAQ)."""
        k, v = codecs
        value_where = replace(where, kind="value")
        everything = torch.arange(keys.shape[1], device=keys.device)
        return [(k.encode(keys, where), v.encode(values, value_where), everything)]


def keep_outliers(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, the `count` entries farthest from the token's median: (x with them set to the
    median, channel index (b, n, count) uint8, value (b, n, count) float16). They are restored
    exactly on decoding, so they no longer stretch the quantization range."""
    xf = x.float()
    centre = xf.median(dim=-1, keepdim=True).values
    index = (xf - centre).abs().topk(count, dim=-1).indices
    kept = torch.gather(xf, -1, index)
    flattened = xf.scatter(-1, index, centre.expand_as(kept))
    return flattened, index.to(torch.uint8), kept.to(META_DTYPE)


def restore_outliers(x: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Put the kept outliers back into x (b, n, d)."""
    return x.scatter(-1, index.long(), value.to(x.dtype))
