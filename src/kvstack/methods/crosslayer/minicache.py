"""`minicache`: MiniCache (Liu et al., NeurIPS 2024, #13): adjacent layers merged in depth.

From the middle of the model on, layers are merged in pairs (l, l+1). Each token's key (and
value) in each layer is split into a magnitude (its norm) and a direction (unit vector); the
pair's directions are interpolated by SLERP at t (toward the deeper layer) and stored ONCE for
both layers (a table both read by row), while each layer keeps its own magnitudes: layer l
reads |x_l| e, layer l+1 reads |x_l+1| e. The tokens whose two states differ most (largest
angular distance) are retained unmerged, in each layer's own states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvstack.cache.coded import Coded
from kvstack.cache.encoded import Encoded, Where, gather_rows
from kvstack.methods.crosslayer.base import (
    CrossLayer,
    TableCodec,
    layer_groups,
    move_to_part,
    real_tokens,
    row_index,
    shared_plain,
)
from kvstack.methods.registry import register

if TYPE_CHECKING:
    from kvstack.cache.layer import CompressedLayer


def disentangle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(magnitude (..., 1), direction (..., d)) of states x (..., d) in float32; a zero state gets
    a zero direction."""
    magnitude = x.float().norm(dim=-1, keepdim=True)
    return magnitude, x.float() / magnitude.clamp(min=torch.finfo(torch.float32).tiny)


def angular_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(...) the angle between unit directions a, b (..., d), divided by pi: 0 same, 1 opposite."""
    return torch.arccos((a * b).sum(-1).clamp(-1.0, 1.0)) / math.pi


def slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """(..., d) spherical interpolation between unit directions a and b (..., d), t in [0, 1]
    toward b: sin((1-t)W)/sin(W) a + sin(tW)/sin(W) b, W the angle between them; near-parallel
    pairs (sin W < 1e-6) interpolate linearly and renormalise."""
    omega = torch.arccos((a * b).sum(-1, keepdim=True).clamp(-1.0, 1.0))
    sin = torch.sin(omega)
    near = sin < 1e-6
    safe = torch.where(near, torch.ones_like(sin), sin)
    curved = (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / safe
    line = (1 - t) * a + t * b
    line = line / line.norm(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(near, line, curved)


def retention(distance: torch.Tensor, candidate: torch.Tensor, real: torch.Tensor, fraction: float) -> torch.Tensor:
    """(b, k) sorted offsets of the candidates to merge, the same count k in every row: per row,
    ceil(fraction x candidates) with the largest angular distance (b, n) are retained; padding
    (not `real`) is merged first; k is the smallest count a row may merge, so a row with more
    candidates retains a few more."""
    n = candidate.sum(1)
    keep = torch.ceil(fraction * n.double()).long()
    k = int((n - keep).min().clamp(min=0))
    score = torch.where(real, distance.double(), -1.0)
    score = torch.where(candidate, score, math.inf)
    chosen = torch.argsort(score, dim=1, stable=True)[:, :k]
    return chosen.sort(dim=1).values


class Polar(TableCodec):
    """Tokens as magnitude (b, n, 1) x a unit direction, row `row` (b, n) of the pair's shared
    direction table (b, N, d); magnitudes and table in the model's dtype."""

    tables: ClassVar[tuple[str, ...]] = ("direction",)

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize
        self.bits = 8 * itemsize

    def __repr__(self) -> str:
        return "Polar()"

    def decode(self, enc: Encoded) -> torch.Tensor:
        return (self.rows(enc, "direction").float() * enc.tokens["magnitude"].float()).to(enc.dtype)

    def token_bytes(self, dim: int) -> float:
        return (dim / 2 + 1) * self.itemsize + 2  # half a shared direction, a magnitude, an int16 row


@register
@dataclass
class MiniCache(CrossLayer):
    """Layers from round(`start` x L) on merge in pairs (`layer_groups`: consecutive layers of the
    same attention kind); `t` the SLERP weight of the deeper layer (paper: 0.6); `retain` the
    fraction of each pair's tokens kept unmerged, those whose key or value directions differ most
    (angular distance max(d_key, d_value)).

    Stored per merged token and head: a row of the pair's two direction tables (keys, values:
    (b, N, d) each, shared by both layers, counted once by `KVCache.nbytes()`), and per layer a key
    and a value magnitude (b, n, 1) in the model's dtype plus the row (b, n) int16; retained tokens
    stay plain, so the head's storage leaves slot order (explicit slots, sorted by
    `storage_order`). Merging is on post-RoPE states: both layers of a pair rotate a position alike
    (same kind, same frequencies) and a rotation commutes with SLERP and norms, so this equals
    merging before RoPE. With `retain=1.0` (or `start=1.0`) nothing merges: the full cache.

    Alone it runs at budget 1.0 and shrinks merged layers by its own ratio (a merged token costs
    the pair about (2d + 6) / 4d of its 16-bit bytes, plus the slots). Stacked after an eviction stage
    (`snapkv+minicache`) the evictor keeps tokens as if each cost its full bytes and the merge then
    shrinks them further, so the cache holds less than the budget; only slots both layers of a
    pair kept are merged. With a quantizer (`minicache+kivi(bits=2)`) the quantizer encodes each
    layer's oldest tokens during its own maintenance, before the pair joins, so only the tokens
    it left plain (its residual window) are merged; a token is then quantized or merged, never
    both, and merged ones stay 16-bit. Tokens that arrive while decoding stay plain.

    Gemma 3: sliding-window layers merge with their sliding neighbours and full-attention layers
    with the next full-attention layer (never across kinds, whose RoPE frequencies differ). A
    window trim, like a later eviction, gathers each layer's rows and magnitudes, never the shared
    directions; a table is rebuilt once under 3/4 of its rows are read (`compact_tables`).

    Deviations: the paper's retention set is a threshold on the distance range (gamma = 0.05);
    here a fraction of the tokens, one set for keys and values (a token is merged or kept whole);
    the paper merges the whole prompt after prefill, here each prompt chunk as it arrives;
    magnitudes are kept in the model's dtype. Reference code read: abdelfattah-lab/xKV
    (slerp_merge_rows_batch, its MiniCache baseline, which merges layers 16-31 of 32).
    """

    name = "minicache"
    paper = "#13"
    start: float = 0.5
    t: float = 0.6
    retain: float = 0.05

    def __post_init__(self) -> None:
        for field_name in ("start", "t", "retain"):
            value = getattr(self, field_name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{self.name}: {field_name} must be in [0, 1], got {value}")

    def groups(self, sliding: list[bool]) -> list[list[int]]:
        return [g for g in layer_groups(sliding, self.start, 2) if len(g) == 2]

    def join_group(self, layers: list[CompressedLayer], lo: int, hi: int) -> None:
        first, second = layers
        for h in range(first.n_kv_heads):
            candidate, (pos_a, pos_b) = shared_plain([(first, h), (second, h)], lo, hi, first.seq)
            if not bool(candidate.any()):
                continue
            at_a, at_b = pos_a.clamp(min=0), pos_b.clamp(min=0)
            states = [gather_rows(x, at) for x, at in ((first.keys[h], at_a), (second.keys[h], at_b))]
            states += [gather_rows(x, at) for x, at in ((first.values[h], at_a), (second.values[h], at_b))]
            (mk_a, dk_a), (mk_b, dk_b), (mv_a, dv_a), (mv_b, dv_b) = (disentangle(x) for x in states)
            distance = torch.maximum(angular_distance(dk_a, dk_b), angular_distance(dv_a, dv_b))
            slots = torch.arange(lo, hi, device=candidate.device).expand(first.batch, -1)
            chosen = retention(distance, candidate, real_tokens(first.seq, slots), self.retain)
            if chosen.shape[1] == 0:
                continue
            dtype, n = first.keys[h].dtype, chosen.shape[1]
            direction_k = slerp(gather_rows(dk_a, chosen), gather_rows(dk_b, chosen), self.t).to(dtype)
            direction_v = slerp(gather_rows(dv_a, chosen), gather_rows(dv_b, chosen), self.t).to(dtype)
            key_codec, value_codec = Polar(first.keys[h].element_size()), Polar(first.keys[h].element_size())
            row = row_index(n, first.batch, chosen.device)  # one tensor: keys and values read the same rows
            for layer, pos, mk, mv in ((first, pos_a, mk_a, mv_a), (second, pos_b, mk_b, mv_b)):
                keys, values = (
                    Encoded(
                        codec,
                        n,
                        direction.shape[-1],
                        dtype,
                        Where(layer.layer_idx, h, kind),
                        {"row": row, "magnitude": gather_rows(magnitude, chosen).to(dtype)},
                        {},
                        {"direction": direction},
                    )
                    for kind, codec, direction, magnitude in (
                        ("key", key_codec, direction_k, mk),
                        ("value", value_codec, direction_v, mv),
                    )
                )
                move_to_part(layer, h, torch.gather(pos, 1, chosen), Coded(keys, values))
