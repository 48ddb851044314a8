"""CQ, coupled quantization (#61): channels quantized jointly against learned codebooks.

Neighbouring channels of a key or value are correlated, so coding `channels` of them together
with one index into a codebook of 2**(bits * channels) centroids beats coding each alone: down
to 1 bit per channel (8 channels, 256 centroids). Codebooks are learned per layer, KV head and
channel group by k-means on keys and values of a few prose samples (State of the Union
addresses; random tokens for a model without a tokenizer), measured once per model and saved
(`kvstack.calibrate`). Codebooks are counted in the cache's bytes (a fixed cost per head: on a
small model at short context it is a real share of the budget). The newest 32 tokens stay in
full precision, as in the paper's 1-bit setting. Deviations: plain k-means (the paper's best
variant weights it by Fisher information), on post-RoPE keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.cache.encoded import META_DTYPE, Codec, Encoded, Where
from kvstack.cache.packing import pack, packed_size, unpack
from kvstack.calibrate.prose import calibration_states
from kvstack.errors import UserError
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import register


class CodebookCodec(Codec):
    """One index per group of `channels` channels into that group's codebook (per layer and head)."""

    def __init__(self, bits: int, channels: int, books: list[list[torch.Tensor]], kind: str) -> None:
        self.bits, self.channels, self.books, self.kind = bits, channels, books, kind
        self.code_bits = bits * channels

    def encode(self, x: torch.Tensor, where: Where) -> Encoded:
        b, n, d = x.shape
        book = self.books[where.layer][where.head].to(x.device)  # (d/c, K, c)
        parts = x.float().reshape(b, n, d // self.channels, self.channels)
        distance = torch.cdist(parts.permute(2, 0, 1, 3).reshape(d // self.channels, b * n, -1), book.float())
        codes = distance.argmin(-1).reshape(d // self.channels, b, n).permute(1, 2, 0)
        tokens = {"codes": pack(codes, self.code_bits) if self.code_bits < 8 else codes.to(torch.uint8)}
        return Encoded(self, n, d, x.dtype, where, tokens, {}, {"codebook": self.books[where.layer][where.head]})

    def decode(self, enc: Encoded) -> torch.Tensor:
        book = enc.shared["codebook"].float()  # (G, K, c)
        groups = enc.dim // self.channels
        codes = enc.tokens["codes"]
        codes = (unpack(codes, self.code_bits, groups) if self.code_bits < 8 else codes).long()  # (b, n, G)
        picked = book[torch.arange(groups, device=codes.device), codes]  # (b, n, G, c)
        return picked.reshape(*codes.shape[:2], enc.dim).to(enc.dtype)

    def token_bytes(self, dim: int) -> float:
        return float(packed_size(dim // self.channels, self.code_bits))

    def fixed_bytes(self, dim: int) -> int:
        return 2**self.code_bits * dim * META_DTYPE.itemsize


def kmeans(points: torch.Tensor, k: int, iterations: int = 12, seed: int = 0) -> torch.Tensor:
    """(G, k, c) centroids of G independent point sets (G, N, c), k-means++-free (random start)."""
    gen = torch.Generator().manual_seed(seed)
    g, n, _ = points.shape
    start = torch.randint(0, n, (g, k), generator=gen)
    centroids = torch.gather(points, 1, start.unsqueeze(-1).expand(-1, -1, points.shape[-1])).clone()
    for _ in range(iterations):
        nearest = torch.cdist(points, centroids).argmin(-1)  # (G, N)
        sums = torch.zeros_like(centroids).scatter_add_(1, nearest.unsqueeze(-1).expand_as(points), points)
        counts = torch.zeros(g, k).scatter_add_(1, nearest, torch.ones(g, n))
        centroids = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), centroids)
    return centroids


@register
@dataclass
class Cq(Quantizer):
    """`bits` bits per channel, `channels` channels coded together (default 8 / bits)."""

    name = "cq"
    paper = "#61"
    channel_groups = False
    bits: int = 1
    channels: int = 0
    samples: int = 4
    tokens: int = 512
    residual: int = field(default=32, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.channels < 0:
            raise ValueError(f"cq: channels must be >= 1 (coupled per code), or 0 for 8 // bits, got {self.channels}")
        if self.channels == 0:
            self.channels = max(1, 8 // self.bits)
        if self.samples < 1 or self.tokens < 2:
            raise ValueError("cq: learn codebooks on samples >= 1 prose samples of tokens >= 2 tokens")
        if self.bits * self.channels > 8:
            raise ValueError(
                f"cq: bits x channels must be at most 8 (a codebook of 256), got {self.bits * self.channels}"
            )

    def check(self, head_dim: int) -> None:
        if head_dim % self.channels:
            raise UserError(f"cq: channels={self.channels} does not divide head_dim={head_dim}: use cq(channels=4)")

    @property
    def kind(self) -> str:
        return f"cq-{self.bits}b{self.channels}c-{self.samples}x{self.tokens}-v1"

    def prepare(self, model: Any) -> torch.Tensor:
        from kvstack.calibrate import measured_on

        return measured_on(model, self.kind, self.learn, "cq learns codebooks on the model")

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        if table is None:
            raise UserError("cq has no codebooks: build the KVCache from the model (KVCache(model, ...))")
        books = [
            [[table[i, h, kind].to(META_DTYPE).clone() for h in range(table.shape[1])] for i in range(table.shape[0])]
            for kind in range(2)
        ]
        return CodebookCodec(self.bits, self.channels, books[0], "key"), CodebookCodec(
            self.bits, self.channels, books[1], "value"
        )

    def learn(self, model: Any) -> torch.Tensor:
        """(L, h_kv, 2, d/c, K, c) codebooks: k-means on the keys and values of prose samples."""
        from kvstack.calibrate.store import Ticker

        states = calibration_states(model, self.samples, self.tokens)
        n_layers, k = len(states), 2 ** (self.bits * self.channels)
        tables = []
        with Ticker(f"cq: learning codebooks ({n_layers} layers)", n_layers) as ticker:
            for i in range(n_layers):
                per_kind = []
                for data in states[i]:  # keys, values (h, N, d)
                    h, n, d = data.shape
                    groups = data.reshape(h, n, d // self.channels, self.channels).permute(0, 2, 1, 3)
                    books = kmeans(groups.reshape(h * (d // self.channels), n, self.channels), min(k, n), seed=i)
                    if books.shape[1] < k:  # fewer points than centroids: repeat the last
                        books = torch.cat([books, books[:, -1:].expand(-1, k - books.shape[1], -1)], 1)
                    per_kind.append(books.reshape(h, d // self.channels, k, self.channels))
                tables.append(torch.stack(per_kind, 1))  # (h, 2, G, K, c)
                ticker.advance()
        return torch.stack(tables)
