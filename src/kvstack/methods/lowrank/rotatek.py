"""`rotatek`: RotateK (#39): rotate each head's keys by PCA, then prune rotated key channels.

Per layer and KV head, the keys are rotated onto the eigenvectors of their second moment
E[k k^T] (an uncentred PCA), which gathers the channels that matter for any token into a few
shared ones; each head then keeps its own `fraction` of rotated channels, those with the most
energy E[(k . u)^2] (a head-wise mask), and prunes the rest to zero. A key (d,) is stored as
its r kept rotated channels in the model's dtype and reads back as coeff @ kept_axes (r, d);
the kept axes are a table per head, counted in the bytes. Values are stored as they are (model
dtype): keys-only compression. Works post-RoPE, on the keys as the cache holds them, so
positions never change. Shapes: keys (b, n, d) -> coeff (b, n, r); axes (r, d) per head.
Default: half the key channels (the abstract gives no ratio; an assumed middle setting).

Deviations: the paper's rotation is computed online per input; here it is fitted once per model on
calibration text (the second moment comes from `pca`'s table: covariance + mean), since a
per-input rotation would be per batch row and chunk and no quantizer could then code the
kept channels (`snapkv+rotatek+kivi(bits=4)` works). Attention rebuilds the pruned keys
rather than running the paper's fused kernel on sparse channels (same product q . k). The
table keeps `Projection`'s layout, so a zero mean (d,) per head is stored and counted too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.cache.encoded import Codec, Encoded, Where
from kvstack.methods.lowrank.base import Projection, Projector, fitted_axes
from kvstack.methods.registry import register


class AsIs(Projection):
    """Tokens stored as they are, in the model's dtype (the values of a keys-only method): a
    projection without tables, so a quantizer stacked after the projector (`Then`) codes them."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.bits = 8 * self.itemsize

    def __repr__(self) -> str:
        return "AsIs()"

    def project(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        return x.clone()  # never a view: it would keep the caller's whole buffer alive

    def restore(self, coeff: torch.Tensor, where: Where, dtype: torch.dtype) -> torch.Tensor:
        return coeff.to(dtype)

    def tables(self, where: Where) -> dict[str, torch.Tensor]:
        return {}

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        return Encoded(self, x.shape[1], x.shape[-1], x.dtype, where, {"x": self.project(x, where)}, {}, {})

    def decode(self, enc: Encoded) -> torch.Tensor:
        return enc.tokens["x"].to(enc.dtype)

    def out_dim(self, dim: int) -> int:
        return dim

    def token_bytes(self, dim: int) -> float:
        return float(dim * self.itemsize)

    def fixed_bytes(self, dim: int) -> int:
        return 0


def second_moment(axes: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """(..., d, d) E[k k^T] = A^T diag(variance) A + mean mean^T, from principal axes A (..., d, d)
    as rows, the mean (..., d) and the variances (..., d) along the axes."""
    a, m, v = axes.double(), mean.double(), variance.double()
    return a.transpose(-1, -2) @ (v.unsqueeze(-1) * a) + m.unsqueeze(-1) * m.unsqueeze(-2)


def rotation(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(axes (..., d, d) as rows, energy (..., d)): the rotation onto the eigenvectors of a second
    moment (..., d, d) and the energy E[(k . u)^2] of each rotated channel, most energy first."""
    energy, vectors = torch.linalg.eigh(moment)  # ascending
    return vectors.flip(-1).transpose(-1, -2), energy.flip(-1).clamp(min=0)


def headwise_mask(energy: torch.Tensor, r: int) -> torch.Tensor:
    """(..., r) the rotated channels each head keeps, ascending: its r with the most energy (..., d)."""
    return energy.topk(r, dim=-1).indices.sort(dim=-1).values


def kept_axes(table: torch.Tensor, r: int) -> list[list[torch.Tensor]]:
    """Per layer and KV head, the r kept rotated axes (r, d) from a `principal_axes` table of keys."""
    d = table.shape[-1]
    keys = table[:, :, 0].double()  # (L, h, d + 2, d)
    axes, energy = rotation(second_moment(keys[..., :d, :], keys[..., d, :], keys[..., d + 1, :]))
    mask = headwise_mask(energy, r)  # (L, h, r)
    kept = torch.gather(axes, -2, mask.unsqueeze(-1).expand(*mask.shape, d)).to(table.dtype)
    return [[kept[i, h].contiguous() for h in range(kept.shape[1])] for i in range(kept.shape[0])]


@register
@dataclass
class RotateK(Projector):
    """`fraction` of each head's rotated key channels kept (values untouched); the rotation is
    fitted on `samples` rows of `tokens` calibration tokens (shared with `pca`)."""

    name = "rotatek"
    paper = "#39"
    fraction: float = 0.5
    samples: int = 4
    tokens: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"rotatek: fraction must be in (0, 1] (key channels kept), got {self.fraction}")
        if self.samples < 1 or self.tokens < 2:
            raise ValueError("rotatek: fit on samples >= 1 rows of tokens >= 2 tokens")

    def ranks(self, head_dim: int) -> tuple[int, int]:
        return max(1, round(self.fraction * head_dim)), head_dim

    def prepare(self, model: Any) -> torch.Tensor:
        return fitted_axes(model, self.samples, self.tokens)

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        assert table is not None, "rotatek needs its fitted axes (prepare)"
        axes = kept_axes(table, self.ranks(table.shape[-1])[0])
        means = [[torch.zeros_like(a[0]) for a in layer] for layer in axes]  # pruned channels read as zero
        return Projection(axes, means), AsIs(table.dtype)
