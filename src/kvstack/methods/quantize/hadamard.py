"""`hadamard`: a random Hadamard rotation of keys and values before a quantizer codes them (QuaRot).

Keys carry a few channels far larger than the rest; a per-token quantizer spends its levels on
them. QuaRot (and SpinQuant, TurboQuant) rotate each head's vectors by one orthogonal matrix
first: inner products are unchanged and the outliers are spread over every channel, so 2-4-bit
codes keep more of each token. Stacked before any quantizer that needs no table of its own
(`snapkv+hadamard+kivi(bits=2)`): the quantizer codes the rotated coordinates and reading
rotates them back, so attention is exact up to the quantizer's error. The rotation is
R = diag(s) H (`rotation`), the same for every layer and head; its signs s (d,) are a table
counted in the bytes. Alone it stores the rotated tokens in the model's dtype (what a
quantizer would code; no saving). Deviations: QuaRot folds R into the weights (W_k R) and
rotates the query instead; here the cache rotates back when it reads (a (d/blk) x blk x blk
product per token, blk the largest power of two dividing d), which keeps the model untouched.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvstack.cache.encoded import Codec, Encoded, Where
from kvstack.methods.lowrank.base import Projection, Projector
from kvstack.methods.quantize.rotation import matrix, random_signs, rotate, unrotate
from kvstack.methods.registry import register
from kvstack.models.config import head_dim, text_config


class Rotation(Projection):
    """All d coordinates on the rotated basis, in the dtype of `signs` (d,) (the model's)."""

    def __init__(self, signs: torch.Tensor) -> None:
        self.signs, self.rank, self.dtype = signs, signs.shape[0], signs.dtype
        self.itemsize = signs.element_size()
        self.bits = 8 * self.itemsize

    def __repr__(self) -> str:
        return f"Rotation(d={self.rank})"

    def project(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        return rotate(x, self.signs).to(self.dtype)

    def restore(self, coeff: torch.Tensor, where: Where, dtype: torch.dtype) -> torch.Tensor:
        return unrotate(coeff, self.signs).to(dtype)

    def tables(self, where: Where) -> dict[str, torch.Tensor]:
        return {"signs": self.signs}

    def basis(self) -> torch.Tensor:
        """(d, d) float32 R: coefficients are x @ R, tokens are coefficients @ R^T (built once)."""
        basis = _BASES.get(self)
        if basis is None or basis.device != self.signs.device:
            basis = _BASES[self] = matrix(self.signs.float())
        return basis

    def decode_turned(self, enc: Encoded, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        return enc.tokens["coeff"].to(dtype), self.basis()

    def fixed_bytes(self, dim: int) -> int:
        return dim * self.itemsize


# Each rotation's basis, kept beside the codec, not in it: a saved cache writes a codec's fields.
_BASES: weakref.WeakKeyDictionary[Rotation, torch.Tensor] = weakref.WeakKeyDictionary()


@register
@dataclass
class Hadamard(Projector):
    """Keys and values rotated by diag(s) H before the next quantizer (s: random signs from `seed`)."""

    name = "hadamard"
    paper = "QuaRot"
    family: ClassVar[str] = "quantize"
    seed: int = 0

    def ranks(self, head_dim: int) -> tuple[int, int]:
        return head_dim, head_dim

    def prepare(self, model: Any) -> torch.Tensor:
        """The signs (d,) in the model's dtype (a bare config: bfloat16, as the cache plans)."""
        d = head_dim(text_config(getattr(model, "config", model)))
        return random_signs(d, self.seed).to(getattr(model, "dtype", torch.bfloat16))

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        assert table is not None, "hadamard needs its signs (prepare)"
        rotation = Rotation(table)
        return rotation, rotation
