"""Attention read off packed integer codes (`Packed`), as KIVI's kernels do: the query is scaled
and multiplied with the codes, and the probabilities with the value codes, without a float copy
of the cache. The work is done by a small C kernel (kernels/packed.c); without it (no compiler,
`KVSTACK_KERNELS=0`, a GPU tensor, 3-bit codes) parts decode to float32 as before."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch

from kvstack.cache.encoded import Encoded, Uniform, gather_rows
from kvstack.cache.kernels import library
from kvstack.cache.packing import packed_size, unpack_float

LANES = 16  # the kernel widens 16 bytes of a token at a time


@dataclass(frozen=True)
class Packed:
    """Uniform codes of h heads laid along the batch as attention lays its queries (row j*h + i:
    sequence j, head i), read as a part of shape (b, h, n, d) ((b, n, d) for one head before
    `unsqueeze(1)`).

    codes (b*h, n, w) uint8; scale, zero (b*h, rows, d / dg) float32, token t reading row rows[t]
    ((b*h, n) int32) or t // tg when `rows` is None, channel c reading column c // dg."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    rows: torch.Tensor | None
    bits: int
    tg: int
    dg: int
    dim: int
    b: int
    h: int
    one_head: bool = False  # shaped (b, n, d): a single head's part, as `head_parts` hands them

    @property
    def shape(self) -> tuple[int, ...]:
        n = self.codes.shape[1]
        return (self.b, n, self.dim) if self.one_head else (self.b, self.h, n, self.dim)

    def unsqueeze(self, dim: int) -> Packed:
        assert self.one_head and dim == 1, "a packed part only gains its head axis"
        return replace(self, one_head=False)

    def decode(self) -> torch.Tensor:
        """The tokens the codes stand for, float32 (b, h, n, d) ((b, n, d) for one head), in torch:
        what the kernel reads, spelled out (tests check the kernel against it)."""
        hb, n, _ = self.codes.shape
        codes = unpack_float(self.codes, self.bits, self.dim).view(hb, n, -1, self.dg)
        rows = self.rows.long() if self.rows is not None else (torch.arange(n) // self.tg).expand(hb, n)
        scale, zero = gather_rows(self.scale, rows).unsqueeze(-1), gather_rows(self.zero, rows).unsqueeze(-1)
        x = (codes * scale + zero).view(self.b, self.h, n, self.dim)
        return x[:, 0] if self.one_head else x

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        """(b*h, G, n) float32: query (b*h, G, d) float32 times every token's keys."""
        q = query.float().contiguous()
        out = torch.empty(q.shape[0], q.shape[1], self.codes.shape[1], dtype=torch.float32)
        self._call("packed_logits", q, out)
        return out

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """(b*h, G, d) float32: probabilities (b*h, G, n) times every token's values."""
        p = probs.float().contiguous()  # a slice of the layer's probabilities
        out = torch.empty(p.shape[0], p.shape[1], self.dim, dtype=torch.float32)
        self._call("packed_mix", p, out)
        return out

    def _call(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        lib = library("packed")
        assert lib is not None
        n, w = self.codes.shape[1], self.codes.shape[2]
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        rows = ptr(self.rows.data_ptr()) if self.rows is not None else None
        getattr(lib, name)(
            i64(self.codes.shape[0]), i64(n), i64(self.dim), i64(w), ctypes.c_int(self.bits),
            ptr(self.codes.data_ptr()), ptr(self.scale.data_ptr()), ptr(self.zero.data_ptr()),
            i64(self.scale.shape[1]), i64(self.tg), i64(self.dg), rows,
            ptr(x.data_ptr()), i64(x.shape[1]), ptr(out.data_ptr()), ctypes.c_int(torch.get_num_threads()),
        )  # fmt: skip


def packed(parts: list[Encoded], one_head: bool = False) -> Packed | None:
    """The parts of h heads (alike: one `Uniform` rule, the same shapes) as one `Packed` part read
    as (b, h, n, d), or as (b, n, d) for `one_head`; None where the kernel does not apply (then
    they are decoded)."""
    first = parts[0]
    codec = first.codec
    if type(codec) is not Uniform or codec.bits not in (1, 2, 4, 8) or first.n == 0:
        return None
    per = 8 // codec.bits  # codes to a byte: a token's bytes come in 16s, a channel group in whole bytes
    if packed_size(first.dim, codec.bits) % LANES or first.dim % per or codec.axis == "token" and codec.group % per:
        return None
    if first.tokens["codes"].device.type != "cpu" or library("packed") is None:
        return None
    codes = _stack([p.tokens["codes"] for p in parts])
    if codec.axis == "token":
        meta = [p.tokens for p in parts]
        tg, dg, rows = 1, codec.group, None
    else:
        meta = [p.groups for p in parts]
        tg, dg = codec.group, 1
        rows = _stack([p.rows() for p in parts]).to(torch.int32).contiguous() if "count" in first.groups else None
    scale = _stack([m["scale"] for m in meta]).float().contiguous()
    zero = _stack([m["zero"] for m in meta]).float().contiguous()
    b, h = codes.shape[0] // len(parts), len(parts)
    return Packed(codes.contiguous(), scale, zero, rows, codec.bits, tg, dg, first.dim, b, h, one_head)


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    """h heads' (b, ...) tensors as (b*h, ...), sequence-major (row j*h + i: sequence j, head i)."""
    return xs[0] if len(xs) == 1 else torch.stack(xs, dim=1).flatten(0, 1)
