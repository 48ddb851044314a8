"""Low-rank storage: keys and values held as coefficients on fewer directions per head.

A `Projector` is a storage stage like a quantizer (it gives the cache a key codec and a value
codec, and keeps its newest `residual` tokens at full dimension), but its codes are
coefficients: a token (d,) becomes (r,) on r orthonormal axes fitted per layer and head, and
reads back as coeff @ axes + mean. The axes and means are tables counted in the cache's bytes.
Stacked with a quantizer (`pca(r=32)+kivi(bits=4)`) the quantizer codes the coefficients
(`Then`). Keys are projected after RoPE, as the cache holds them, so positions never change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvstack.cache.encoded import Codec, Encoded, Where
from kvstack.errors import UserError
from kvstack.methods.quantize.base import Quantizer


class Projection(Codec):
    """Coefficients on r axes per layer and head: axes[layer][head] (r, d), means (d,), both in
    the dtype the coefficients are stored in (the model's)."""

    def __init__(self, axes: list[list[torch.Tensor]], means: list[list[torch.Tensor]]) -> None:
        self.axes, self.means = axes, means
        self.rank = axes[0][0].shape[0]
        self.dtype = axes[0][0].dtype  # the coefficients' dtype (the model's)
        self.itemsize = axes[0][0].element_size()
        self.bits = 8 * self.itemsize

    def __repr__(self) -> str:
        return f"Projection(r={self.rank})"

    def project(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        """(b, n, r) coefficients of x (b, n, d), in the table's dtype."""
        axes, mean = self.axes[where.layer][where.head], self.means[where.layer][where.head]
        coeff = (x.float() - mean.float()) @ axes.float().T
        return coeff.to(axes.dtype)

    def restore(self, coeff: torch.Tensor, where: Where, dtype: torch.dtype) -> torch.Tensor:
        """(b, n, d) in `dtype` from coefficients (b, n, r)."""
        axes, mean = self.axes[where.layer][where.head], self.means[where.layer][where.head]
        return (coeff.float() @ axes.float() + mean.float()).to(dtype)

    def tables(self, where: Where) -> dict[str, torch.Tensor]:
        return {"axes": self.axes[where.layer][where.head], "mean": self.means[where.layer][where.head]}

    def basis(self) -> torch.Tensor | None:
        """(d, d) float32 R when the coefficients are x @ R for one orthogonal R (a rotation: attention
        reads them as they are, its query turned); None for fitted axes and means (they decode)."""
        return None

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        tokens = {"coeff": self.project(x, where)}
        return Encoded(self, x.shape[1], x.shape[-1], x.dtype, where, tokens, {}, self.tables(where))

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.restore(enc.tokens["coeff"], enc.where, enc.dtype)

    def out_dim(self, dim: int) -> int:
        return self.rank

    def token_bytes(self, dim: int) -> float:
        return float(self.rank * self.itemsize)

    def fixed_bytes(self, dim: int) -> int:
        return (self.rank + 1) * dim * self.itemsize


class Then(Codec):
    """A projection whose coefficients a quantizer's codec then encodes (`pca(r=32)+kivi(bits=4)`):
    tensors are the inner codec's, plus the projection's tables."""

    def __init__(self, outer: Projection, inner: Codec) -> None:
        self.outer, self.inner = outer, inner
        self.bits, self.token_group = inner.bits, inner.token_group
        self.batchable = inner.batchable  # heads decode as one batch when they share the tables too (`alike`)

    def __repr__(self) -> str:
        return f"Then({self.outer!r}, {self.inner!r})"

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        inner = self.inner.encode(self.outer.project(x, where), where)
        shared = {**inner.shared, **self.outer.tables(where)}
        return Encoded(self, x.shape[1], x.shape[-1], x.dtype, where, inner.tokens, inner.groups, shared)

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.outer.restore(self.inner.decode(self._inner_view(enc)), enc.where, enc.dtype)

    def decode_turned(self, enc: Encoded, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        basis = self.outer.basis()  # a rotation (`hadamard`): the coefficients as they are
        if basis is None:
            return None
        return self.inner.decode_as(self._inner_view(enc), dtype), basis

    def _inner_view(self, enc: Encoded) -> Encoded:
        tables = self.outer.tables(enc.where)
        shared = {k: v for k, v in enc.shared.items() if k not in tables}
        rank = self.outer.out_dim(enc.dim)
        return Encoded(self.inner, enc.n, rank, self.outer.dtype, enc.where, enc.tokens, enc.groups, shared)

    def token_bytes(self, dim: int) -> float:
        return self.inner.token_bytes(self.outer.out_dim(dim))

    def fixed_bytes(self, dim: int) -> int:
        return self.outer.fixed_bytes(dim) + self.inner.fixed_bytes(self.outer.out_dim(dim))


@dataclass
class Projector(Quantizer):
    """Base of the low-rank stages: `codecs(table)` gives projections (see module docstring);
    `residual` newest tokens stay at full dimension (0 by default: every token is projected)."""

    family: ClassVar[str] = "lowrank"
    codes_coefficients: ClassVar[bool] = True  # False when its codes are not on fixed axes (a quantizer cannot follow)
    residual: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        if self.residual < 0:
            raise ValueError(f"{self.name}: residual must be >= 0 (newest tokens kept at full dimension)")

    def ranks(self, head_dim: int) -> tuple[int, int]:
        """Dimensions kept for keys and for values."""
        raise NotImplementedError

    def check(self, head_dim: int) -> None:
        for rank in self.ranks(head_dim):
            if not 1 <= rank <= head_dim:
                raise UserError(f"{self.name}: rank {rank} is out of range for head_dim={head_dim}: use 1..{head_dim}")


def principal_axes(states: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(L, h, 2, d + 2, d) per layer, KV head and kind (keys, values): the d principal axes as
    rows sorted by variance, then the mean, then the variances. states: per layer (keys, values),
    each (h, N, d) float32."""
    tables = []
    for pair in states:
        per_kind = []
        for x in pair:
            mean = x.mean(1, keepdim=True)  # (h, 1, d)
            centred = (x - mean).double()
            cov = centred.transpose(1, 2) @ centred / max(x.shape[1] - 1, 1)  # (h, d, d)
            variance, vectors = torch.linalg.eigh(cov)  # ascending
            axes = vectors.flip(-1).transpose(1, 2).float()  # (h, d, d) rows, most variance first
            per_kind.append(torch.cat([axes, mean, variance.flip(-1).float().unsqueeze(1)], 1))
        tables.append(torch.stack(per_kind, 1))
    return torch.stack(tables)


def fitted_axes(model: Any, samples: int, tokens: int) -> torch.Tensor:
    """`principal_axes` of the keys and values the model produces on calibration text, measured
    once per model and saved (`kvstack.calibrate`), returned in the model's dtype."""
    from kvstack.calibrate import measured_on
    from kvstack.calibrate.prose import calibration_states

    kind = f"pca-{samples}x{tokens}-v1"
    fit = lambda m: principal_axes(calibration_states(m, samples, tokens))  # noqa: E731
    table = measured_on(model, kind, fit, "a projection is fitted on the model")
    return table.to(getattr(model, "dtype", torch.float32))


def projections(table: torch.Tensor, key_rank: int, value_rank: int) -> tuple[Projection, Projection]:
    """Key and value projections keeping the top `key_rank` / `value_rank` axes of a
    `principal_axes` table."""
    d = table.shape[-1]
    out = []
    for kind, rank in ((0, key_rank), (1, value_rank)):
        axes = [[table[i, h, kind, :rank].clone() for h in range(table.shape[1])] for i in range(table.shape[0])]
        means = [[table[i, h, kind, d].clone() for h in range(table.shape[1])] for i in range(table.shape[0])]
        out.append(Projection(axes, means))
    return out[0], out[1]


@dataclass(frozen=True)
class Projected:
    """A projector followed by a quantizer that codes its coefficients, acting as one storage
    stage for the cache (`snapkv+pca(r=32)+kivi(bits=4)`): the quantizer's residual window and
    groups, the projector's tables."""

    projector: Projector
    quantizer: Quantizer

    @property
    def name(self) -> str:
        return f"{self.projector.name}+{self.quantizer.name}"

    @property
    def residual(self) -> int:
        return max(self.projector.residual, self.quantizer.residual)

    @property
    def query_window(self) -> int:
        return 0

    def check(self, head_dim: int) -> None:
        self.projector.check(head_dim)
        for rank in set(self.projector.ranks(head_dim)):
            self.quantizer.check(rank)

    def prepare(self, model: Any) -> torch.Tensor | None:
        return self.projector.prepare(model)

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        outer = self.projector.codecs(table)
        inner = self.quantizer.codecs(None)
        return Then(outer[0], inner[0]), Then(outer[1], inner[1])  # type: ignore[arg-type]

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, where: Where, codecs: tuple[Codec, Codec], layer: Any
    ) -> list[tuple[Encoded, Encoded, torch.Tensor]]:
        return Quantizer.encode(self.quantizer, keys, values, where, codecs, layer)


def can_follow_projection(quantizer: Quantizer) -> str | None:
    """Why a quantizer cannot code a projection's coefficients, or None when it can: it must
    need no table of its own, no queries and one precision for all tokens."""
    if type(quantizer).prepare is not Quantizer.prepare:
        return "it learns tables on full-dimension states"
    if quantizer.query_window or type(quantizer).encode is not Quantizer.encode:
        return "it codes tokens with queries or per-token precisions"
    return None
