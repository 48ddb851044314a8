"""Tokens held in a compact form: packed codes plus whatever a method needs to read them back.

A `Codec` is a quantization rule (bits, grouping, outliers, low-rank error, codebooks); it turns
one head's keys or values (b, n, d) into an `Encoded` and back. `Encoded` keeps its tensors in
three kinds, so the cache can gather and count them without knowing the method: one row per
token (gathered when tokens are evicted), one row per group of `token_group` tokens (re-encoded
when an eviction breaks a group), and shared tables (a codebook). Every tensor is counted in
the cache's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvstack.cache.packing import pack, packed_size, unpack_float

META_DTYPE = torch.float16  # scales and zeros, as KIVI stores them


@dataclass(frozen=True)
class Where:
    """Which tensor a codec encodes: layer, KV head, "key" or "value", the head's observed
    queries (b, g, w, d) for methods that quantize with the queries in mind (SQuat), and the
    positions (b, n) of the tokens being encoded with the layer's RoPE inverse frequencies
    (d/2,) for methods that undo the rotation (ShadowKV's pre-RoPE keys)."""

    layer: int
    head: int
    kind: str
    queries: Callable[[], torch.Tensor | None] = lambda: None
    positions: Callable[[], torch.Tensor | None] = lambda: None
    inv_freq: torch.Tensor | None = None


class Codec:
    """A rule that encodes (b, n, d) tensors into an `Encoded` and decodes them back."""

    bits: int = 16
    token_group: int = 1  # tokens the cache encodes at once, sharing a row of group tensors if any
    # its `token_group` only batches calls, nothing is shared between the tokens: the cache may
    # code fewer at once where the budget needs it (`kvstack.cache.window`)
    batches_only: bool = False
    # its codes can be decoded, turned to new positions and encoded again on their own (a cache
    # joined after another: kvstack.cache.join); not so for codes that read other layers' tables
    # or their tokens' positions
    turnable: bool = True
    # rule-only: its tensors read no per-head table, so several heads' parts decode as one batch
    # (`coded.decode_heads`) when `same` holds
    batchable: bool = False
    # its `encode` reads nothing of `where` (no table, query or position) and codes each batch row
    # on its own: several heads' tokens encode in one call, their rows laid along the batch
    rows_alike: bool = False

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded) -> torch.Tensor:
        """(b, n, d) in the encoded tensor's dtype."""
        raise NotImplementedError

    def decode_as(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        """(b, n, d) in `dtype` (attention reads float32: a codec computing in it can skip a
        round trip through the model's dtype)."""
        return self.decode(enc).to(dtype)

    def decode_turned(self, enc: Encoded, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For codes held on a rotated basis: (y (b, n, d) in `dtype`, R (d, d) float32 orthogonal)
        with the tokens = y @ R^T, so attention turns the query (q R) and its output (o R^T)
        instead of every token; None when the codec has no such form (then `decode_as`)."""
        return None

    def level_codes(self, enc: Encoded) -> LevelForm | None:
        """For codes read as norm * levels[code] on a rotated basis (TurboQuant's), what a kernel
        needs to attend them without decoding (`kvstack.cache.levels`); None for other rules."""
        return None

    def token_bytes(self, dim: int) -> float:
        """Bytes one token costs once encoded (codes plus metadata shared within its group)."""
        raise NotImplementedError

    def fixed_bytes(self, dim: int) -> int:
        """Bytes per head that do not grow with tokens (a codebook)."""
        return 0

    def same(self, other: Codec) -> bool:
        """True when tokens coded by `other` may join a part coded by this codec: the same object
        (a codec with tables), or the same rule for codecs without (`Uniform`)."""
        return self is other


@dataclass(frozen=True)
class LevelForm:
    """How a part's codes read as tokens: token t is norm[t] * levels[codes[t]] @ basis^T, the
    codes `bits` wide (b, n, bytes) uint8, norm (b, n) float16, `table` the levels' `chunk_table`
    (2^c, k) float32, basis (d, d) orthogonal float32."""

    codes: torch.Tensor
    norm: torch.Tensor
    bits: int
    table: torch.Tensor
    basis: torch.Tensor


@dataclass(frozen=True)
class Turned:
    """Tokens on a rotated basis: the tokens are `y @ basis^T`, y (..., t, d), basis (d, d)
    orthogonal float32. Attention reads them as they are, with its query turned by the basis."""

    y: torch.Tensor
    basis: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.y.shape

    def unsqueeze(self, dim: int) -> Turned:
        return Turned(self.y.unsqueeze(dim), self.basis)


@dataclass(eq=False)
class Encoded:
    """n tokens of one head in a codec's form (see module docstring). Tensors lead with (b, rows)."""

    codec: Codec
    n: int
    dim: int
    dtype: torch.dtype
    where: Where
    tokens: dict[str, torch.Tensor]  # (b, n, ...)
    groups: dict[str, torch.Tensor]  # (b, ceil(n / token_group), ...)
    shared: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        # the queries and positions an encoder looked at are not kept (they would stay alive,
        # uncounted): an encoding done again after an eviction rounds without them
        self.where = Where(self.where.layer, self.where.head, self.where.kind, inv_freq=self.where.inv_freq)

    def decode(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(b, n, d) the tokens as the model reads them (in `dtype` when given)."""
        return self.codec.decode(self) if dtype is None else self.codec.decode_as(self, dtype)

    def read(self, dtype: torch.dtype) -> torch.Tensor | Turned:
        """What attention reads: the tokens on their rotated basis when the codec keeps one
        (`Turned`, no rotation per token), else decoded (b, n, d) in `dtype`."""
        turned = self.codec.decode_turned(self, dtype)
        return self.decode(dtype) if turned is None else Turned(*turned)

    def rows(self) -> torch.Tensor:
        """(b, n) the group row each token reads its group tensors from: token // token_group while
        groups are whole runs, else from the counts of what each group holds."""
        count = self.groups.get("count")
        if count is None:
            any_group = next(iter(self.groups.values()))
            runs = torch.arange(self.n, device=any_group.device) // self.codec.token_group
            return runs.expand(any_group.shape[0], -1)
        ends = count.long().cumsum(1)  # (b, m)
        b, m = ends.shape
        at = torch.arange(self.n, device=ends.device).expand(b, self.n).contiguous()
        return torch.searchsorted(ends, at, right=True).clamp(max=m - 1)

    def counts(self) -> torch.Tensor:
        """(b, m) tokens per group (whole runs of `token_group`, the last one maybe shorter)."""
        if "count" in self.groups:
            return self.groups["count"].long()
        g, any_group = self.codec.token_group, next(iter(self.groups.values()))
        b, m = any_group.shape[:2]
        count = torch.full((b, m), g, dtype=torch.long, device=any_group.device)
        count[:, -1] = self.n - (m - 1) * g
        return count

    def per_token(self, name: str) -> torch.Tensor:
        """The group tensor `name` (b, m, ...) read per token: (b, n, ...), each group's row
        repeated for the tokens it holds (every batch row holds n, so the rows flatten into one
        `repeat_interleave`: no per-token index is built on the decoding path)."""
        x = self.groups[name]
        b, m = x.shape[:2]
        flat = x.reshape(b * m, *x.shape[2:])
        repeated = torch.repeat_interleave(flat, self.counts().reshape(-1), dim=0, output_size=b * self.n)
        return repeated.reshape(b, self.n, *x.shape[2:])

    def take(self, index: torch.Tensor) -> Encoded:
        """The tokens at `index` (b, k), sorted in each row. Per-token tensors are gathered; groups
        keep their tensors and count the tokens they still hold (no rounding again), dropping
        groups empty in every row; once the groups left are under 3/4 full on average, the tokens
        are encoded again into whole groups, so metadata per token stays bounded."""
        tokens = {k: gather_rows(v, index) for k, v in self.tokens.items()}
        if not self.groups:
            return replace(self, n=index.shape[1], tokens=tokens)
        kept_rows = torch.gather(self.rows(), 1, index)  # (b, k), non-decreasing
        m = self.counts().shape[1]
        count = torch.zeros(index.shape[0], m, dtype=torch.long, device=index.device)
        count.scatter_add_(1, kept_rows, torch.ones_like(kept_rows))
        used = count.sum(0) > 0
        k = index.shape[1]
        if k < 0.75 * int(used.sum()) * self.codec.token_group:  # too sparse: whole groups again
            return self.codec.encode(gather_rows(self.decode(), index), self.where)
        groups = {name: v[:, used] for name, v in self.groups.items() if name != "count"}
        groups["count"] = count[:, used].to(torch.int16)
        return replace(self, n=k, tokens=tokens, groups=groups)

    def cat(self, other: Encoded) -> Encoded:
        """These tokens followed by `other`'s (same codec): groups are concatenated as they are
        (a part ending in a short group carries group counts from then on)."""
        if self.groups and ("count" in self.groups or "count" in other.groups or self.n % self.codec.token_group):
            groups = {
                name: torch.cat([v, other.groups[name]], dim=1) for name, v in self.groups.items() if name != "count"
            }
            groups["count"] = torch.cat([self.counts(), other.counts()], dim=1).to(torch.int16)
            return replace(
                self,
                n=self.n + other.n,
                tokens={k: torch.cat([v, other.tokens[k]], dim=1) for k, v in self.tokens.items()},
                groups=groups,
                shared=other.shared,
            )
        return replace(
            self,
            n=self.n + other.n,
            tokens={k: torch.cat([v, other.tokens[k]], dim=1) for k, v in self.tokens.items()},
            groups={k: torch.cat([v, other.groups[k]], dim=1) for k, v in self.groups.items()},
            shared=other.shared,
        )

    def batch_rows(self, start: int, stop: int, head: int) -> Encoded:
        """Batch rows start..stop of these tokens (views), as head `head`'s: several heads encoded
        in one call, their rows laid along the batch, split back."""
        return replace(
            self,
            where=Where(self.where.layer, head, self.where.kind, inv_freq=self.where.inv_freq),
            tokens={k: v[start:stop] for k, v in self.tokens.items()},
            groups={k: v[start:stop] for k, v in self.groups.items()},
        )

    def select_batch(self, index: torch.Tensor) -> Encoded:
        """Keep only batch rows `index`."""
        return replace(
            self,
            tokens={k: v[index] for k, v in self.tokens.items()},
            groups={k: v[index] for k, v in self.groups.items()},
        )

    def tensors(self) -> list[torch.Tensor]:
        return [*self.tokens.values(), *self.groups.values(), *self.shared.values()]


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (b, k) of x (b, n, ...) (x may be broadcast over the batch: (1, n, ...)).

    One `index_select` over the flattened rows: `torch.gather` would need an index as large as
    the output (k * d int64s), built and read at every call on the decoding path."""
    b, k = index.shape
    if x.shape[0] != b:
        x = x.expand(b, *x.shape[1:])
    n = x.shape[1]
    flat = (index.long() + torch.arange(b, device=index.device).unsqueeze(1) * n).reshape(-1)
    return x.reshape(b * n, *x.shape[2:]).index_select(0, flat).reshape(b, k, *x.shape[2:])


# ---- uniform (min-max) quantization, the building block of most methods -------------------
def minmax(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization of x along `dim`: (codes uint8, scale, zero), the last two
    stored in float16 with `dim` kept as size 1. x ~ codes * scale + zero, error <= scale / 2."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).to(META_DTYPE)
    zero = lo.to(META_DTYPE)
    s = scale.float()
    codes = torch.where(s > 0, torch.round((xf - zero.float()) / torch.where(s > 0, s, 1.0)), 0.0)
    return codes.clamp(0, 2**bits - 1).to(torch.uint8), scale, zero


class Uniform(Codec):
    """Group-wise asymmetric integer codes. axis="token": each token's channels in groups of
    `group` share a scale and zero (per-token quantization); axis="channel": each channel's
    values over `group` consecutive tokens share them (KIVI's keys)."""

    def __init__(self, bits: int, axis: str = "token", group: int = 32) -> None:
        self.bits, self.axis, self.group = bits, axis, group
        self.token_group = group if axis == "channel" else 1

    batchable = rows_alike = True

    def __repr__(self) -> str:
        return f"Uniform({self.bits}, {self.axis}, {self.group})"

    def same(self, other: Codec) -> bool:
        # a rule alone: a cache loaded from a file joins its parts with the codecs it makes anew
        return (
            self is other
            or type(other) is type(self) is Uniform
            and (self.bits, self.axis, self.group) == (other.bits, other.axis, other.group)
        )

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        b, n, d = x.shape
        if self.axis == "token":
            codes, scale, zero = minmax(x.reshape(b, n, d // self.group, self.group), self.bits, dim=-1)
            tokens = {"codes": pack(codes.reshape(b, n, d), self.bits), "scale": scale[..., 0], "zero": zero[..., 0]}
            return Encoded(self, n, d, x.dtype, where, tokens, {}, {})
        g = self.group
        pad = (-n) % g
        xp = torch.cat([x, x[:, -1:].expand(b, pad, d)], dim=1) if pad else x  # repeat: keeps the range
        codes, scale, zero = minmax(xp.reshape(b, -1, g, d), self.bits, dim=2)
        packed = pack(codes.reshape(b, -1, d)[:, :n], self.bits)
        return Encoded(
            self, n, d, x.dtype, where, {"codes": packed}, {"scale": scale[:, :, 0], "zero": zero[:, :, 0]}, {}
        )

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.decode_as(enc, enc.dtype)

    def decode_as(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        # codes * scale + zero in float32, written over the fresh codes (no second full-size tensor)
        b, n, d = enc.tokens["codes"].shape[0], enc.n, enc.dim
        codes = unpack_float(enc.tokens["codes"], self.bits, d)
        if self.axis == "token":
            c = codes.reshape(b, n, d // self.group, self.group)
            c.mul_(enc.tokens["scale"].unsqueeze(-1)).add_(enc.tokens["zero"].unsqueeze(-1))
            return c.reshape(b, n, d).to(dtype)
        if "count" in enc.groups:  # groups thinned by evictions: each token reads its own group
            return codes.mul_(enc.per_token("scale")).add_(enc.per_token("zero")).to(dtype)
        g = self.group
        pad = (-n) % g  # a group broadcasts over its tokens: (b, m, g, d) * (b, m, 1, d)
        c = torch.cat([codes, codes.new_zeros(b, pad, d)], dim=1) if pad else codes
        c = c.reshape(b, -1, g, d)
        c.mul_(enc.groups["scale"].unsqueeze(2)).add_(enc.groups["zero"].unsqueeze(2))
        return c.reshape(b, -1, d)[:, :n].to(dtype)

    def token_bytes(self, dim: int) -> float:
        meta = 2 * META_DTYPE.itemsize
        # groups of tokens are planned at 3/4 full: evictions thin them that far before a re-encode
        per_token = dim // self.group * meta if self.axis == "token" else dim * meta / (0.75 * self.group)
        return packed_size(dim, self.bits) + per_token
