"""SQuat (#2): key quantization error kept orthogonal to the subspace the queries span.

A key's error only matters through q . (k_hat - k). From the head's observed queries (b, g*w, d)
an SVD gives the top `rank` directions, Q^ = diag(sigma) V_r^T, and the error is measured by
A = I + lam * Q^T Q^ / (g*w). Keys are quantized KIVI-style (per channel over `group` tokens),
one block of `block` channels at a time; after each block the channels still to come absorb its
error, x_rest -= A_rr^-1 A_rt e_t (GPTQ-style feedback), which pushes the error out of the
query span. Values are per-token as in KIVI. Defaults from the reference code
(Red-Hat-AI-Innovation-Team/SQuat, llama_squat.py): rank 20, residual 32, group 32; `block`
16 so a 64-wide head has four blocks (one block would be plain KIVI). Deviation: queries are
the last `queries` observed (the reference uses the whole prompt), so lam is taken relative to
the mean query (the reference's 1e-3 multiplies a sum over the prompt); keys encoded again
after an eviction broke their group are rounded plain (KIVI), the queries not being kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.cache.encoded import Codec, Encoded, Uniform, Where, minmax
from kvstack.cache.packing import pack
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import register


class SquatCodec(Uniform):
    """KIVI's per-channel key codes, chosen block by block with error feedback through A."""

    rows_alike = False  # its codes are chosen with the head's queries

    def __init__(self, bits: int, group: int, block: int, rank: int, lam: float) -> None:
        super().__init__(bits, "channel", group)
        self.block, self.rank, self.lam = block, rank, lam

    def metric(self, queries: torch.Tensor, d: int) -> torch.Tensor:
        """(b, d, d) A = I + lam * V_r diag(sigma^2) V_r^T / n for queries (b, g, w, d)."""
        q = queries.float().reshape(queries.shape[0], -1, d)
        _, s, vh = torch.linalg.svd(q, full_matrices=False)
        r = min(self.rank, s.shape[-1])
        v = vh[:, :r]  # (b, r, d)
        span = torch.einsum("brd,br,bre->bde", v, s[:, :r] ** 2, v) / q.shape[1]
        return torch.eye(d, device=q.device) + self.lam * span

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        queries = where.queries()
        if queries is None:
            return super().encode(x, where)
        b, n, d = x.shape
        g = self.group
        pad = (-n) % g
        work = (torch.cat([x, x[:, -1:].expand(b, pad, d)], 1) if pad else x).float().clone()
        a = self.metric(queries, d)
        codes, scales, zeros = [], [], []
        for lo in range(0, d, self.block):
            hi = min(lo + self.block, d)
            blk = work[..., lo:hi].reshape(b, -1, g, hi - lo)
            c, s, z = minmax(blk, self.bits, dim=2)
            error = (c.float() * s.float() + z.float()).reshape(b, -1, hi - lo) - work[..., lo:hi]
            codes.append(c.reshape(b, -1, hi - lo))
            scales.append(s[:, :, 0])
            zeros.append(z[:, :, 0])
            if hi < d:  # the channels to come absorb this block's error
                feedback = torch.linalg.solve(a[:, hi:, hi:], a[:, hi:, lo:hi])  # (b, rest, blk)
                work[..., hi:] -= torch.einsum("bnt,brt->bnr", error, feedback)
        packed = pack(torch.cat(codes, -1)[:, :n], self.bits)
        groups = {"scale": torch.cat(scales, -1), "zero": torch.cat(zeros, -1)}
        return Encoded(self, n, d, x.dtype, where, {"codes": packed}, groups, {})


@register
@dataclass
class Squat(Quantizer):
    """`bits`-bit keys whose error avoids the query subspace; KIVI values."""

    name = "squat"
    paper = "#2"
    bits: int = 2
    group: int = 32
    block: int = 16
    rank: int = 20
    lam: float = 1.0
    queries: int = 64
    residual: int = field(default=32, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block < 1 or self.rank < 0 or self.queries < 0:
            raise ValueError("squat: block >= 1 (channels per step), rank >= 0 and queries >= 0 please")

    @property
    def query_window(self) -> int:
        return self.queries

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        return SquatCodec(self.bits, self.group, self.block, self.rank, self.lam), Uniform(
            self.bits, "token", self.group
        )
