"""`shadowkv`: ShadowKV (#17): low-rank pre-RoPE keys, values kept aside at full precision.

Works pre-RoPE: the key codec undoes each token's rotation (its position from
`Where.positions`, the layer's `inv_freq`), since keys before RoPE share a low-rank subspace
that the position-dependent rotation smears, then fits an SVD on the prompt itself, one per
chunk of `chunk` tokens and batch row. A token keeps r coefficients (b, n, r) in the model's
dtype and its position (int32, to re-apply RoPE); a chunk keeps its top r right singular
vectors (b, chunks, r, d); all are counted in the bytes. Reading rebuilds coeff @ basis and
rotates it back to each token's position. Values are stored as they are, in the model's dtype
(ShadowKV offloads them to the CPU; here they count as held). The newest `residual` tokens stay
post-RoPE at full dimension (ShadowKV's local window: 4 chunks of 8 = 32 tokens). Defaults:
r = 32 per head (the paper: rank 160 shared by 8 heads of 128, i.e. 20 per head), chunk 256.

Deviations: ShadowKV fits one SVD per layer over all KV heads side by side (h*d columns) on
the whole prefill; here one per head and chunk of tokens, as the cache encodes them in groups
(tokens generated later are compressed too; the paper keeps them exact). Its sparse attention
(each step, chunk landmarks - mean post-RoPE keys of 8 tokens - pick the chunks to rebuild,
and outlier chunks stay exact) is not implemented: the attention path gives a codec no query,
so every key is rebuilt each step (dense attention over the low-rank keys, the accuracy the
selection approximates) and no landmarks or outliers are stored. A quantizer cannot code the
coefficients (the factors are per chunk, not tables): the parser refuses `shadowkv+kivi`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvstack.cache.encoded import Codec, Encoded, Where, gather_rows
from kvstack.methods.lowrank.base import Projector
from kvstack.methods.lowrank.rotatek import AsIs
from kvstack.methods.registry import register
from kvstack.models.rope import rotate


def undo_rope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """(b, n, d) float32 keys before RoPE, from keys (b, n, d) rotated at positions (b, n)
    (unchanged when the layer has no RoPE, or rotates only part of the head)."""
    if inv_freq is None or 2 * inv_freq.numel() != keys.shape[-1]:
        return keys.float()
    return rotate(keys.float(), -positions.float(), inv_freq)


def redo_rope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """(b, n, d) float32 keys (b, n, d) rotated to their positions (b, n): the inverse of `undo_rope`."""
    if inv_freq is None or 2 * inv_freq.numel() != keys.shape[-1]:
        return keys.float()
    return rotate(keys.float(), positions.float(), inv_freq)


def chunk_svd(x: torch.Tensor, rank: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-`rank` SVD of x (b, n, d) per chunk of `chunk` tokens: (coeff (b, n, r) = U S,
    basis (b, ceil(n / chunk), r, d) = V^T), so x ~ coeff @ basis of each token's chunk.
    The last chunk is padded with zero rows, which leave its singular vectors unchanged."""
    b, n, d = x.shape
    pad = (-n) % chunk
    xp = torch.cat([x.float(), x.new_zeros(b, pad, d, dtype=torch.float32)], 1) if pad else x.float()
    u, s, vh = torch.linalg.svd(xp.reshape(b, -1, chunk, d), full_matrices=False)
    coeff = (u[..., :rank] * s[..., None, :rank]).reshape(b, -1, rank)[:, :n]
    return coeff, vh[..., :rank, :]


def rebuild(coeff: torch.Tensor, basis: torch.Tensor, chunk: int) -> torch.Tensor:
    """(b, n, d) float32 coeff (b, n, r) @ basis (b, chunks, r, d), tokens in whole chunks."""
    b, n, r = coeff.shape
    pad = (-n) % chunk
    c = torch.cat([coeff.float(), coeff.new_zeros(b, pad, r, dtype=torch.float32)], 1) if pad else coeff.float()
    return (c.reshape(b, -1, chunk, r) @ basis.float()).reshape(b, -1, basis.shape[-1])[:, :n]


def own(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype` in storage of its own: a slice of the SVD's factors would keep them alive (and counted)."""
    return x.to(dtype).clone(memory_format=torch.contiguous_format)


class Positioned(Encoded):
    """Keys that carry their positions: when `take` encodes the survivors again (their chunks
    grown sparse after evictions), it undoes RoPE with these positions."""

    def take(self, index: torch.Tensor) -> Encoded:
        view = copy.copy(self)  # no __post_init__: the positions stay for this one encoding
        positions = gather_rows(self.tokens["pos"], index)
        view.where = replace(self.where, positions=lambda: positions)
        return Encoded.take(view, index)


class ShadowKeys(Codec):
    """Keys as rank-r factors of their pre-RoPE form, per chunk of `chunk` tokens (see module docstring)."""

    turnable = False  # encoding reads the tokens' positions, which a stored part no longer keeps

    def __init__(self, rank: int, chunk: int, dtype: torch.dtype) -> None:
        self.rank, self.token_group = rank, chunk
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.bits = 8 * self.itemsize

    def __repr__(self) -> str:
        return f"ShadowKeys(r={self.rank}, chunk={self.token_group})"

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        b, n, d = x.shape
        positions = where.positions()
        if positions is None:
            raise ValueError("shadowkv encodes keys with their positions: Where.positions gave none")
        positions = own(positions.expand(b, n), torch.int32)
        coeff, basis = chunk_svd(undo_rope(x, positions, where.inv_freq), self.rank, self.token_group)
        tokens = {"coeff": own(coeff, x.dtype), "pos": positions}
        return Positioned(self, n, d, x.dtype, where, tokens, {"basis": own(basis, x.dtype)}, {})

    def decode(self, enc: Encoded) -> torch.Tensor:
        coeff = enc.tokens["coeff"]
        if "count" in enc.groups:  # chunks thinned by evictions: each token reads its own basis
            pre = torch.einsum("bnr,bnrd->bnd", coeff.float(), enc.per_token("basis").float())
        else:
            pre = rebuild(coeff, enc.groups["basis"], self.token_group)
        return redo_rope(pre, enc.tokens["pos"], enc.where.inv_freq).to(enc.dtype)

    def token_bytes(self, dim: int) -> float:
        # coefficients, the int32 position, and the chunk's basis planned at 3/4 full (like every group)
        return self.rank * self.itemsize + 4 + self.rank * dim * self.itemsize / (0.75 * self.token_group)


@register
@dataclass
class ShadowKV(Projector):
    """Rank `r` pre-RoPE keys per head, an SVD per `chunk` tokens; values as they are; the newest
    `residual` tokens at full dimension."""

    name = "shadowkv"
    paper = "#17"
    codes_coefficients = False
    r: int = 32
    chunk: int = 256
    residual: int = field(default=32, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.r < 1 or self.chunk < self.r:
            raise ValueError(
                f"shadowkv: r must be >= 1 and chunk >= r (an SVD per chunk of tokens), got r={self.r}, "
                f"chunk={self.chunk}"
            )

    def ranks(self, head_dim: int) -> tuple[int, int]:
        return self.r, head_dim

    def prepare(self, model: Any) -> torch.Tensor:
        """Nothing to measure: an empty table in the model's dtype, the dtype factors are counted in."""
        dtype = getattr(model, "dtype", None)
        return torch.empty(0, dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32)

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        dtype = table.dtype if table is not None else torch.float32
        return ShadowKeys(self.r, self.chunk, dtype), AsIs(dtype)
