"""GEAR (#32): uniform codes, plus a low-rank matrix for their error, plus a few outliers exact.

X ~ Q(X - S) + S + L: S keeps each token's largest-magnitude entries in float16 (set to the
median before quantizing, so they stop stretching the range); Q is KIVI's layout (keys per
channel over each chunk, values per token); L is a rank-`rank` approximation of what Q and S leave over,
computed per chunk of `chunk` tokens (GEAR's streaming buffer) by SVD and stored as per-token
factors (n, r) and per-chunk factors (r, d). Defaults from the reference code
(HaoKang-Timmy/GEAR, compress_function.py): rank 4, outliers 2% (1 per token of a 64-wide
head), chunk 64. Deviation: outliers are chosen per token for keys too (GEAR: per channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.cache.encoded import META_DTYPE, Codec, Encoded, Uniform, Where
from kvstack.methods.quantize.base import Quantizer, keep_outliers, restore_outliers
from kvstack.methods.registry import register


class GearCodec(Codec):
    """Uniform codes + per-token outliers + a per-chunk low-rank error."""

    def __init__(self, bits: int, axis: str, group: int, rank: int, outliers: float, chunk: int) -> None:
        # keys: per channel over the chunk's tokens (one grouping of tokens for codes and factors)
        self.base = Uniform(bits, axis, chunk if axis == "channel" else group)
        self.bits, self.rank, self.outliers = bits, rank, outliers
        self.token_group = chunk

    def n_outliers(self, dim: int) -> int:
        return max(1, round(self.outliers * dim)) if self.outliers > 0 else 0

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        b, n, d = x.shape
        k = self.n_outliers(d)
        flat, index, value = keep_outliers(x, k) if k else (x.float(), None, None)
        enc = self.base.encode(flat.to(x.dtype), where)
        enc.codec = self
        err = flat - self.base.decode(enc).float()
        if k:
            err = err.scatter(-1, index.long(), 0.0)
            enc.tokens.update(oidx=index, oval=value)
        c, r = self.token_group, min(self.rank, self.token_group, d)
        if r == 0:
            return enc
        pad = (-n) % c
        err = torch.cat([err, err.new_zeros(b, pad, d)], 1) if pad else err
        u, s, vh = torch.linalg.svd(err.reshape(b, -1, c, d), full_matrices=False)
        a = (u[..., :r] * s[..., None, :r]).reshape(b, -1, r)[:, :n]
        enc.tokens["a"] = a.to(META_DTYPE)
        enc.groups["b"] = vh[..., :r, :].to(META_DTYPE)  # (b, chunks, r, d)
        return enc

    def decode(self, enc: Encoded) -> torch.Tensor:
        out = self.base.decode(enc).float()
        if "a" in enc.tokens:
            factors = enc.per_token("b").float()  # (b, n, r, d)
            out = out + torch.einsum("bnr,bnrd->bnd", enc.tokens["a"].float(), factors)
        if "oidx" in enc.tokens:
            out = restore_outliers(out, enc.tokens["oidx"], enc.tokens["oval"])
        return out.to(enc.dtype)

    def token_bytes(self, dim: int) -> float:
        r = min(self.rank, dim)
        low_rank = r * META_DTYPE.itemsize + r * dim * META_DTYPE.itemsize / (0.75 * self.token_group)
        return self.base.token_bytes(dim) + low_rank + self.n_outliers(dim) * (1 + META_DTYPE.itemsize)


@register
@dataclass
class Gear(Quantizer):
    """KIVI-layout `bits`-bit codes, rank-`rank` error correction, `outliers` of entries exact."""

    name = "gear"
    paper = "#32"
    bits: int = 2
    group: int = 32
    rank: int = 4
    outliers: float = 0.02
    chunk: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank < 0 or not 0 <= self.outliers < 1 or self.chunk < 1:
            raise ValueError("gear: rank >= 0, outliers in [0, 1) and chunk >= 1 please")

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        args = (self.rank, self.outliers, self.chunk)
        return GearCodec(self.bits, "channel", self.group, *args), GearCodec(self.bits, "token", self.group, *args)
