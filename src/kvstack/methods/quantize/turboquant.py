"""`turboquant`: TurboQuant (Zandieh et al. 2025): a random rotation, then levels optimal for every coordinate.

A unit vector in d dimensions, randomly rotated, has coordinates that all follow one known
law, density proportional to (1 - x^2)^((d - 3) / 2) on [-1, 1] (about N(0, 1/d)), whatever the
vector was. So one set of 2^b levels, the Lloyd-Max quantizer of that law (`lloyd_max`), is
near-optimal for every token with no scale or zero per group: a token keeps its norm (float16)
and b-bit codes of its rotated direction. Reading looks the levels up, rotates back and scales
by the norm. With `qjl=True` the keys spend one of their bits on QJL (TurboQuant_prod): the
residual r of the (b-1)-bit codes is kept as sign(S r) for a Gaussian S (d, d) and |r|
(float16), and reads back as sqrt(pi/2) / d * |r| * S^T sign(S r), which makes every query's
inner product with the key unbiased (`qjl_estimate`). Values are averaged, not matched, and keep
the MSE codes. The rotation is `rotation`'s randomized Hadamard.

Reference read: the paper (arXiv 2504.19874). Deviations: a randomized Hadamard rotation
instead of a dense random one (the same coordinate law for vectors that are not adversarial);
the paper's split of outlier channels into a second instance (its 2.5 and 3.5 bits) is not
done; the newest `residual` tokens stay in the model's dtype as in KIVI (default 128; while
decoding the window empties by `every` once full, so `residual - every + 1` to `residual`). The
levels are a data type like float16's, computed from (d, b) alone, so they are not counted.
Attention reads the codes in place (`kvstack.cache.levels`: the query turned once, each token's
levels looked up a chunk at a time by a C kernel), except with `qjl` or `center`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from kvstack.cache.encoded import META_DTYPE, Codec, Encoded, LevelForm, Where
from kvstack.cache.packing import check_bits, chunk_table, lookup, pack, packed_size, unpack_float
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.quantize.rotation import random_signs, rotate, seeded_matrix, unrotate
from kvstack.methods.registry import register

GRID = 32_000  # points of the density's grid, none at 0 (levels settle to ~1e-4 of the range)


def lloyd_max(x: torch.Tensor, density: torch.Tensor, n_levels: int, iters: int = 300) -> torch.Tensor:
    """(n_levels,) float64 levels minimising the mean squared error of rounding to the nearest
    level, for a law given on a uniform grid x (N,) by its (unnormalised) density (N,):
    Lloyd's iteration, each boundary half-way between levels, each level the mean of its cell."""
    x, w = x.double(), density.double() / density.double().sum()
    cdf = w.cumsum(0)
    levels = x[torch.searchsorted(cdf, (torch.arange(n_levels, dtype=torch.float64) + 0.5) / n_levels)]
    for _ in range(iters):
        cell = torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(n_levels, dtype=torch.float64).scatter_add_(0, cell, w)
        moment = torch.zeros(n_levels, dtype=torch.float64).scatter_add_(0, cell, w * x)
        levels = torch.where(mass > 0, moment / mass.clamp(min=1e-300), levels)
    return levels


@cache
def sphere_levels(d: int, bits: int) -> torch.Tensor:
    """(2^bits,) float32 Lloyd-Max levels for one coordinate of a random unit vector in d dimensions."""
    x = torch.linspace(-1, 1, GRID, dtype=torch.float64)
    density = (1 - x * x).clamp(min=0) ** ((d - 3) / 2) if d > 3 else torch.ones_like(x)
    levels = lloyd_max(x, density, 2**bits)
    return ((levels - levels.flip(0)) / 2).float()  # the law is symmetric: so are its levels


_QJL: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def qjl_matrix(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """(d, d) float32 Gaussian S of QJL, the same for the same (d, seed); built once per device."""
    key = (d, seed, torch.device(device))
    if key not in _QJL:
        gen = torch.Generator().manual_seed(seed)
        _QJL[key] = torch.randn(d, d, generator=gen).to(device)
    return _QJL[key]


def qjl_estimate(signs: torch.Tensor, norm: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(..., d) the QJL reading of a residual: sqrt(pi/2) / m * |r| * S^T sign(S r), from
    signs (..., m) of +1 / -1, norm (..., 1) and S (m, d); unbiased: E_S[q . it] = q . r."""
    return math.sqrt(math.pi / 2) / s.shape[0] * norm * (signs @ s)


def nearest_level(y: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """(...) int64 index of the level (L,) sorted ascending nearest each entry of y (...): how many
    mid-points it passes (one comparison per boundary, ~8x faster than `torch.bucketize` on CPU
    for the few levels of 1-4 bits)."""
    bounds = (levels[1:] + levels[:-1]) / 2
    if bounds.numel() > 15:
        return torch.bucketize(y.contiguous(), bounds)
    codes = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for bound in bounds.tolist():
        codes += y > bound
    return codes.long()


_TABLES: dict[tuple[int, int, torch.device], torch.Tensor] = {}


class TurboCodec(Codec):
    """A token's norm and its rotated direction coded on `sphere_levels` (+ QJL when `qjl`); with
    `center` > 0, first less the mean of its run of `center` tokens (float16, one per run). The
    cache codes `every` tokens at once (`center` tokens with it): nothing is shared between them,
    but a call for 8 tokens costs what a call for one does (coding each token as it came took 40%
    of a decoding step at 4k on SmolLM2)."""

    batchable = rows_alike = True
    every: int = 8  # a class default too: caches saved before it existed load with it

    def __init__(self, bits: int, qjl: bool = False, seed: int = 0, center: int = 0, every: int = 8) -> None:
        self.bits, self.qjl, self.seed, self.center, self.every = bits, qjl, seed, center, every
        self.mse_bits = bits - 1 if qjl else bits
        self.token_group = center or every
        self.batches_only = not center  # a run's mean is shared by its tokens; nothing else is

    def __repr__(self) -> str:
        return f"TurboCodec({self.bits}{', qjl' if self.qjl else ''}{f', center={self.center}' if self.center else ''})"

    def same(self, other: Codec) -> bool:
        rule = (self.bits, self.qjl, self.seed, self.center, self.every)
        return self is other or (
            isinstance(other, TurboCodec) and rule == (other.bits, other.qjl, other.seed, other.center, other.every)
        )

    def _levels(self, d: int, device: torch.device) -> torch.Tensor:
        return sphere_levels(d, self.mse_bits).to(device)

    def _table(self, d: int, device: torch.device) -> torch.Tensor:
        """`chunk_table` of the levels, built once per (d, bits, device): read at every step."""
        key = (d, self.mse_bits, torch.device(device))
        if key not in _TABLES:
            _TABLES[key] = chunk_table(self._levels(d, device), self.mse_bits)
        return _TABLES[key]

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        b, n, d = x.shape
        xf, groups = x.float(), {}
        if self.center:
            g = self.center
            runs = torch.arange(n, device=x.device) // g  # (n,) the run each token is in
            m = (n + g - 1) // g
            sums = xf.new_zeros(b, m, d).index_add_(1, runs, xf)
            counts = torch.bincount(runs, minlength=m).clamp(min=1).to(xf.dtype)
            groups["mean"] = (sums / counts[:, None]).to(META_DTYPE)
            xf = xf - groups["mean"].float()[:, runs]
        norm = xf.norm(dim=-1, keepdim=True)
        y = rotate(xf / norm.clamp(min=1e-30), random_signs(d, self.seed))  # (b, n, d), about N(0, 1/d) each
        levels = self._levels(d, x.device)
        codes = nearest_level(y, levels)
        tokens = {"codes": pack(codes, self.mse_bits), "norm": norm.to(META_DTYPE)}
        if self.qjl:
            r = y - levels[codes]
            signs = (r @ qjl_matrix(d, self.seed + 1, x.device).T) >= 0
            tokens |= {"qjl": pack(signs.to(torch.uint8), 1), "residual": r.norm(dim=-1, keepdim=True).to(META_DTYPE)}
        return Encoded(self, n, d, x.dtype, where, tokens, groups, {})

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.decode_as(enc, enc.dtype)

    def _turned(self, enc: Encoded) -> torch.Tensor:
        """(b, n, d) float32 the tokens on the rotated basis, less their run's mean: y |x - mean|."""
        d, device = enc.dim, enc.tokens["codes"].device
        y = lookup(enc.tokens["codes"], self.mse_bits, d, self._table(d, device))  # (b, n, d) levels
        if self.qjl:
            signs = unpack_float(enc.tokens["qjl"], 1, d) * 2 - 1
            s = qjl_matrix(d, self.seed + 1, device)
            y = y + qjl_estimate(signs, enc.tokens["residual"].float(), s)
        return y.mul_(enc.tokens["norm"].float())

    def decode_as(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        x = unrotate(self._turned(enc), random_signs(enc.dim, self.seed))
        if self.center:
            x = x + enc.per_token("mean").float()
        return x.to(dtype)

    def decode_turned(self, enc: Encoded, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.center:  # a mean per run is not on the rotated basis
            return None
        y = self._turned(enc)
        return y.to(dtype), seeded_matrix(enc.dim, self.seed, y.device)

    def level_codes(self, enc: Encoded) -> LevelForm | None:
        if self.qjl or self.center:  # a residual's estimate or a run's mean is not a level
            return None
        d, device = enc.dim, enc.tokens["codes"].device
        basis = seeded_matrix(d, self.seed, device)
        return LevelForm(enc.tokens["codes"], enc.tokens["norm"][..., 0], self.mse_bits, self._table(d, device), basis)

    def token_bytes(self, dim: int) -> float:
        extra = packed_size(dim, 1) + META_DTYPE.itemsize if self.qjl else 0
        mean = dim * META_DTYPE.itemsize / (0.75 * self.center) if self.center else 0  # runs planned 3/4 full
        return packed_size(dim, self.mse_bits) + META_DTYPE.itemsize + extra + mean


@register
@dataclass
class TurboQuant(Quantizer):
    """Keys and values at `bits` bits on Lloyd-Max levels after a random rotation; `v`: the
    values' bits when not the keys'; `qjl`: keys spend one bit on QJL for unbiased inner
    products (TurboQuant_prod); `every`: tokens coded at once past the residual window (1: each
    as it comes, as the paper does; the window is then `max(residual, every - 1)` tokens, full
    after a prompt, emptied `every` at a time while decoding: `kvstack.cache.window`)."""

    name = "turboquant"
    paper = "TurboQuant"
    channel_groups = False
    bits: int = 3
    qjl: bool = False
    seed: int = 0
    center: int = 0
    v: int | None = None
    every: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qjl:
            if self.bits < 2:
                raise ValueError(f"{self.name}: qjl spends one of the bits on the residual: use bits=2 or more")
            check_bits(self.bits - 1, self.name)
        if self.center < 0:
            raise ValueError(f"{self.name}: center is the tokens sharing a mean (0: none), got {self.center}")
        if self.every < 1:
            raise ValueError(f"{self.name}: every is the tokens coded at once (1: each as it comes), got {self.every}")

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        keys = TurboCodec(self.bits, self.qjl, self.seed, self.center, self.every)
        values = TurboCodec(self.bits if self.v is None else self.v, False, self.seed, self.center, self.every)
        return keys, values
