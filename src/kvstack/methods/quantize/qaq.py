"""QAQ (#18): each token's bit width from its attention, separately for keys and values.

A token that draws attention a_i tolerates less error. With L tokens held and a_i the most
attention any of the last `window` queries gives token i, the error a key may carry is
sqrt(T_k / d) / (L * q_max * x_i), x_i = a_i * max(1 - a_i, max_j a_j) (the largest entry of
the softmax Jacobian's row), and a value sqrt(T_v) / (L * a_i); the bits are the fewest whose
step keeps the token's range within twice that error, clamped to [n_min, n_max] and rounded up
to a width kvstack packs. A fraction `outliers` of each token's entries stays in float16.
Codes are per token (one scale and zero). Defaults from the reference code
(ClubieDong/QAQ-KVCacheQuantization, quantizer.py and its grid search): window 5, q_max 3,
n_min 2, n_max 8, outliers 1%; T_k = 1e5, T_v = 1e2 picked from its grid. Deviation: in a
batch a token position takes the widest bits any sequence asks for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kvstack.cache.attention import attention_probs, head_mask
from kvstack.cache.encoded import META_DTYPE, Codec, Encoded, Uniform, Where
from kvstack.cache.packing import BIT_WIDTHS
from kvstack.methods.quantize.base import Quantizer, keep_outliers, restore_outliers
from kvstack.methods.registry import register


class OutlierUniform(Codec):
    """Per-token codes (one scale and zero per token) with a fraction `outliers` of each token's
    most extreme entries kept in float16. `family` maps every width QAQ may pick to its codec."""

    def __init__(self, bits: int, outliers: float, family: dict[int, OutlierUniform]) -> None:
        self.bits, self.outliers, self.family = bits, outliers, family

    def count(self, dim: int) -> int:
        return round(self.outliers * dim)

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        base, count = Uniform(self.bits, "token", x.shape[-1]), self.count(x.shape[-1])
        if not count:
            enc = base.encode(x, where)
        else:
            flat, index, value = keep_outliers(x, count)
            enc = base.encode(flat.to(x.dtype), where)
            enc.tokens.update(oidx=index, oval=value)
        enc.codec = self
        return enc

    def decode(self, enc: Encoded) -> torch.Tensor:
        out = Uniform(self.bits, "token", enc.dim).decode(enc)
        return restore_outliers(out, enc.tokens["oidx"], enc.tokens["oval"]) if "oidx" in enc.tokens else out

    def token_bytes(self, dim: int) -> float:
        return Uniform(self.bits, "token", dim).token_bytes(dim) + self.count(dim) * (1 + META_DTYPE.itemsize)


@register
@dataclass
class Qaq(Quantizer):
    """Per-token key and value bit widths from attention (see module docstring)."""

    name = "qaq"
    paper = "#18"
    window: int = 5
    t_k: float = 1e5
    t_v: float = 1e2
    q_max: float = 3.0
    n_min: int = 2
    n_max: int = 8
    outliers: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (1 <= self.n_min <= self.n_max <= 8):
            raise ValueError(f"qaq: need 1 <= n_min <= n_max <= 8, got n_min={self.n_min}, n_max={self.n_max}")
        if min(self.t_k, self.t_v, self.q_max) <= 0 or not 0 <= self.outliers < 1:
            raise ValueError("qaq: t_k, t_v and q_max must be > 0 and outliers in [0, 1)")

    @property
    def query_window(self) -> int:
        return self.window

    def widths(self) -> list[int]:
        return [w for w in BIT_WIDTHS if self.n_min <= w <= self.n_max] or [self.n_max]

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        """The widest codecs (what the budget plans with: QAQ's cost is only known per token);
        each carries the family of every width, per cache."""
        family: dict[int, OutlierUniform] = {}
        family.update({w: OutlierUniform(w, self.outliers, family) for w in self.widths()})
        return family[max(family)], family[max(family)]

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, where: Where, codecs: tuple[Codec, Codec], layer: Any
    ) -> list[tuple[Encoded, Encoded, torch.Tensor]]:
        b, n, d = keys.shape
        family = codecs[0].family  # type: ignore[attr-defined]
        attn = self.attention(layer, where.head, where.queries(), n)  # (b, n)
        held = layer.head_len(where.head)
        x = attn * torch.maximum(1 - attn, attn.amax(-1, keepdim=True))
        err_k = (self.t_k / d) ** 0.5 / (held * self.q_max * x.clamp(min=1e-12))
        err_v = self.t_v**0.5 / (held * attn.clamp(min=1e-12))
        bits_k = self.bits_for(keys, err_k).amax(0)  # (n,) the widest any sequence asks for
        bits_v = self.bits_for(values, err_v).amax(0)
        out = []
        value_where = replace(where, kind="value")
        for wk in family:
            for wv in family:
                pos = torch.nonzero((bits_k == wk) & (bits_v == wv)).flatten()
                if pos.numel():
                    out.append(
                        (family[wk].encode(keys[:, pos], where), family[wv].encode(values[:, pos], value_where), pos)
                    )
        return out

    def bits_for(self, x: torch.Tensor, max_error: torch.Tensor) -> torch.Tensor:
        """(b, n) the supported width whose step keeps each token's error within max_error."""
        spread = x.float().amax(-1) - x.float().amin(-1)
        need = torch.ceil(torch.log2(spread / (2 * max_error) + 1)).clamp(self.n_min, self.n_max)
        widths = torch.tensor(self.widths(), device=x.device)
        return widths[torch.searchsorted(widths, need.long().clamp(max=int(widths[-1])))]

    def attention(self, layer: Any, h: int, queries: torch.Tensor | None, n: int) -> torch.Tensor:
        """(b, n) the most attention any observed query gives each of the n oldest tokens held in
        the model's dtype (zeros when no query was observed)."""
        start = sum(c.n for c in layer.coded[h])
        b = layer.batch
        if queries is None:
            return torch.zeros(b, n, device=layer.keys[h].device)
        slots = layer.head_slots(h)
        assert layer.query_slots is not None
        mask = head_mask(slots, layer.query_slots, layer.seq.padding, layer.sliding_window)
        p = attention_probs(queries, layer.head_keys(h), mask, layer.scaling)  # (b, g, w, t)
        return p.amax(dim=(1, 2))[:, start : start + n]
