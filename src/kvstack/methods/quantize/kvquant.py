"""`kvquant`: KVQuant (Hooper et al. 2024): pre-RoPE per-channel keys, non-uniform levels, sparse outliers.

Three observations, three parts. (1) Key channels differ in range by orders of magnitude and
RoPE mixes pairs of them by position, so keys are quantized per channel *before* RoPE: each
token's rotation is undone with its position (kept, int32), the key coded, and RoPE applied
again when read. (2) Keys and values are not uniformly spread: non-uniform levels (NUQ), fitted
once per layer and head on calibration prose (State of the Union, `kvstack.calibrate`), place
the 2^b levels where the normalised entries are (`lloyd_max` on their histogram). (3) A few
entries per vector are far outside the rest: the `outliers` fraction of each token's entries
that lie farthest out are kept exactly (channel uint8, value float16; dense-and-sparse), so
the range fits the others. Keys are normalised per channel by calibrated thresholds (the
0.5% and 99.5% quantiles, no metadata per token); values per token by their own min and max
without the outliers (float16 midpoint and half-range). (4) The first `sinks` tokens of each
sequence, the attention sink whose key lies far outside every channel's range (measured on
SmolLM2: relative error 1.5 at 3 bits in layer 15 where other keys have 0.06), are kept in
the model's dtype (KVQuant's attention-sink-aware variant); their bytes are planned as fixed
per head. Shapes: keys, values (b, n, d).

Reference read: the paper (arXiv 2401.18079) and SqueezeAILab/KVQuant. Deviations: levels by
plain 1-D k-means (Lloyd) where the paper weights entries by Fisher information; a fixed count
of outliers per token (KVQuant's per-vector thresholds give a count that varies) so every token
costs the same bytes; levels and thresholds per head (the paper: per layer); the newest
`residual` tokens stay in the model's dtype as in KIVI; in a left-padded batch the sink of
any row is kept exact in every row (one rectangular split).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kvstack.cache.encoded import META_DTYPE, Codec, Encoded, Where
from kvstack.cache.packing import pack, packed_size, unpack
from kvstack.errors import UserError
from kvstack.methods.lowrank.rotatek import AsIs
from kvstack.methods.lowrank.shadowkv import redo_rope, undo_rope
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.quantize.turboquant import lloyd_max, nearest_level
from kvstack.methods.registry import register

CLIP = 0.005  # each side of a channel's calibrated range left to the outliers (KVQuant: 1% in all)
BINS = 4001  # histogram of normalised entries the levels are fitted on


def outlier_count(fraction: float, dim: int) -> int:
    """Entries per token kept exactly: `fraction` of dim, at least one when fraction > 0."""
    return max(1, round(fraction * dim)) if fraction > 0 else 0


def range_without(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(midpoint, half-range) (b, n, 1) of each token of x (b, n, d) without its entries at index."""
    out = torch.zeros_like(x, dtype=torch.bool).scatter(-1, index, True)
    lo = torch.where(out, float("inf"), x).amin(-1, keepdim=True)
    hi = torch.where(out, float("-inf"), x).amax(-1, keepdim=True)
    lo, hi = torch.where(torch.isfinite(lo), lo, 0.0), torch.where(torch.isfinite(hi), hi, 0.0)
    return (hi + lo) / 2, ((hi - lo) / 2).clamp(min=1e-6)


def fit_levels(u: torch.Tensor, n_levels: int) -> torch.Tensor:
    """(n_levels,) float32 levels on [-1, 1] minimising the squared error of the entries u (N,)."""
    grid = torch.linspace(-1, 1, BINS, dtype=torch.float64)
    index = ((u.double().clamp(-1, 1) + 1) / 2 * (BINS - 1)).round().long()
    density = torch.zeros(BINS, dtype=torch.float64).scatter_add_(0, index, torch.ones_like(index, dtype=torch.float64))
    return lloyd_max(grid, density + 1e-12, n_levels).float()


class NuqCodec(Codec):
    """Keys (pre-RoPE, per channel) or values (per token) on per-head levels, outliers exact.

    tables[layer][head] (4, W) float16: key lower and upper thresholds (d,), key levels, value
    levels (2^bits,), W = max(d, 2^bits); shared by the head's key and value codecs."""

    turnable = False  # keys carry their positions: a cache joined at new positions cannot move them

    def __init__(
        self, bits: int, outliers: float, tables: list[list[torch.Tensor]], kind: str, exact: AsIs, sinks: int
    ) -> None:
        self.bits, self.outliers, self.tables, self.kind = bits, outliers, tables, kind
        self.exact, self.sinks = exact, sinks  # the codec of the sink tokens, and how many a sequence has

    def __repr__(self) -> str:
        return f"NuqCodec({self.bits}, {self.kind}, outliers={self.outliers:g})"

    def _levels(self, table: torch.Tensor) -> torch.Tensor:
        return table[2 if self.kind == "key" else 3, : 2**self.bits].float()

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        b, n, d = x.shape
        table, count = self.tables[where.layer][where.head], outlier_count(self.outliers, d)
        tokens: dict[str, torch.Tensor] = {}
        if self.kind == "key":
            positions = where.positions()
            if positions is None:
                raise ValueError("kvquant encodes keys before RoPE: Where.positions gave none")
            tokens["pos"] = positions.expand(b, n).to(torch.int32).clone()
            pre = undo_rope(x, tokens["pos"], where.inv_freq)
            lo, hi = table[0, :d].float(), table[1, :d].float()
            mid, half = (hi + lo) / 2, ((hi - lo) / 2).clamp(min=1e-6)
            index = ((pre - mid) / half).abs().topk(count, dim=-1).indices  # (b, n, count)
        else:
            pre = x.float()
            index = (pre - pre.median(-1, keepdim=True).values).abs().topk(count, dim=-1).indices
            mid, half = range_without(pre, index)
            tokens |= {"mid": mid.to(META_DTYPE), "half": half.to(META_DTYPE)}
        u = ((pre - mid) / half).scatter(-1, index, 0.0).clamp(-1, 1)
        if count:
            tokens |= {"out_index": index.to(torch.uint8), "out_value": torch.gather(pre, -1, index).to(META_DTYPE)}
        tokens["codes"] = pack(nearest_level(u, self._levels(table)), self.bits)
        return Encoded(self, n, d, x.dtype, where, tokens, {}, {"table": table})

    def decode(self, enc: Encoded) -> torch.Tensor:
        table, d = enc.shared["table"], enc.dim
        u = self._levels(table)[unpack(enc.tokens["codes"], self.bits, d).long()]
        if self.kind == "key":
            lo, hi = table[0, :d].float(), table[1, :d].float()
            mid, half = (hi + lo) / 2, ((hi - lo) / 2).clamp(min=1e-6)
        else:
            mid, half = enc.tokens["mid"].float(), enc.tokens["half"].float()
        x = u * half + mid
        if "out_index" in enc.tokens:
            x = x.scatter(-1, enc.tokens["out_index"].long(), enc.tokens["out_value"].float())
        if self.kind == "key":
            x = redo_rope(x, enc.tokens["pos"], enc.where.inv_freq)
        return x.to(enc.dtype)

    def token_bytes(self, dim: int) -> float:
        per_token = 4 if self.kind == "key" else 2 * META_DTYPE.itemsize  # position / midpoint and half-range
        return packed_size(dim, self.bits) + outlier_count(self.outliers, dim) * (1 + META_DTYPE.itemsize) + per_token

    def fixed_bytes(self, dim: int) -> int:
        sinks = self.sinks * int(self.exact.token_bytes(dim))
        return sinks + (4 * max(dim, 2**self.bits) * META_DTYPE.itemsize if self.kind == "key" else 0)


@register
@dataclass
class KVQuant(Quantizer):
    """Keys pre-RoPE per channel and values per token at `bits` bits on fitted non-uniform levels,
    the `outliers` fraction of each token's entries kept exactly; fitted on `samples` prose rows of
    `tokens` tokens."""

    name = "kvquant"
    paper = "KVQuant"
    channel_groups = False
    bits: int = 3
    outliers: float = 0.01
    sinks: int = 1
    samples: int = 4
    tokens: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.outliers < 0.5:
            raise ValueError(
                f"kvquant: outliers is the fraction of each token's entries kept exactly: 0 to 0.5, got {self.outliers}"
            )
        if self.sinks < 0:
            raise ValueError(f"kvquant: sinks is the first tokens kept in the model's dtype (>= 0), got {self.sinks}")
        if self.samples < 1 or self.tokens < 16:
            raise ValueError("kvquant: fit on samples >= 1 prose rows of tokens >= 16 tokens")

    @property
    def kind(self) -> str:
        return f"kvquant-{self.bits}b-{self.outliers:g}-{self.samples}x{self.tokens}-v1"

    def prepare(self, model: Any) -> torch.Tensor:
        from kvstack.calibrate import measured_on

        table = measured_on(model, self.kind, self.learn, "kvquant fits its levels on the model")
        return table.to(getattr(model, "dtype", torch.float32))

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        if table is None:
            raise UserError("kvquant has no levels: build the KVCache from the model (KVCache(model, ...))")
        tables = [[table[i, h].to(META_DTYPE).clone() for h in range(table.shape[1])] for i in range(table.shape[0])]
        exact = AsIs(table.dtype)  # the table comes in the model's dtype (`prepare`)
        return tuple(NuqCodec(self.bits, self.outliers, tables, kind, exact, self.sinks) for kind in ("key", "value"))

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, where: Where, codecs: tuple[Codec, Codec], layer: Any
    ) -> list[tuple[Encoded, Encoded, torch.Tensor]]:
        """The sinks (positions below `sinks` in any row) kept as they are, the rest coded."""
        positions = where.positions()
        sink = (positions < self.sinks).any(0) if positions is not None and self.sinks else None
        if sink is None or not bool(sink.any()):
            return super().encode(keys, values, where, codecs, layer)
        exact = codecs[0].exact  # type: ignore[attr-defined]
        first, rest = sink.nonzero()[:, 0], (~sink).nonzero()[:, 0]
        value_where = replace(where, kind="value")
        out = [(exact.encode(keys[:, first], where), exact.encode(values[:, first], value_where), first)]
        if rest.numel():
            coded = replace(where, positions=lambda: positions[:, rest])
            parts = super().encode(keys[:, rest], values[:, rest], coded, codecs, layer)
            out += [(k, v, rest[at]) for k, v, at in parts]
        return out

    def learn(self, model: Any) -> torch.Tensor:
        """(L, h_kv, 4, W) per layer and head: key thresholds (2 rows of d), key levels, value levels
        (W = max(d, 2^bits)), from the keys and values the model produces on prose."""
        from kvstack.calibrate.prose import calibration_states
        from kvstack.calibrate.store import Ticker
        from kvstack.models.config import text_config
        from kvstack.models.rope import layer_frequencies

        states = calibration_states(model, self.samples, self.tokens)
        config = text_config(model.config)
        d = states[0][0].shape[-1]
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(states)
        freqs = layer_frequencies(model, types, d)
        n_levels, width = 2**self.bits, max(d, 2**self.bits)
        count = outlier_count(self.outliers, d)
        tables = []
        with Ticker(f"kvquant: fitting levels ({len(states)} layers)", len(states)) as ticker:
            for (keys, values), inv_freq in zip(states, freqs, strict=True):
                h, n, _ = keys.shape
                positions = torch.arange(n) % (n // self.samples)  # rows of `tokens`, each from position 0
                pre = undo_rope(keys, positions.expand(h, n), inv_freq)  # (h, N, d)
                lo, hi = pre.quantile(CLIP, dim=1), pre.quantile(1 - CLIP, dim=1)  # (h, d)
                u_keys = (pre - ((hi + lo) / 2)[:, None]) / ((hi - lo) / 2).clamp(min=1e-6)[:, None]
                index = (values - values.median(-1, keepdim=True).values).abs().topk(count, dim=-1).indices
                mid, half = range_without(values, index)
                u_values = ((values - mid) / half).scatter(-1, index, 2.0)  # outliers out of [-1, 1]: not fitted
                table = torch.zeros(h, 4, width)
                table[:, 0, :d], table[:, 1, :d] = lo, hi
                for head in range(h):
                    for row, u in ((2, u_keys[head]), (3, u_values[head])):
                        table[head, row, :n_levels] = fit_levels(u[u.abs() <= 1], n_levels)
                tables.append(table)
                ticker.advance()
        return torch.stack(tables)
