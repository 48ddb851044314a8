"""Attention read off packed integer codes (`Packed`), as KIVI's kernels do: the query is scaled
and multiplied with the codes, and the probabilities with the value codes, without a float copy
of the cache. The work is done by a small C kernel (kernels/packed.c); without it (no compiler,
`KVSTACK_KERNELS=0`, a GPU tensor, 3-bit codes) parts decode to float32 as before."""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from kvstack.cache.encoded import Encoded, Uniform, gather_rows
from kvstack.cache.kernels import library, pointer, stack_heads
from kvstack.cache.levels import LevelCodes, level_codes
from kvstack.cache.packing import packed_size, unpack_float

LANES = 16  # the kernel widens 16 bytes of a token at a time
# one head's `Packed` part, kept beside its `Encoded` part while that lives (never saved with it)
_KEPT: weakref.WeakKeyDictionary[Encoded, Packed | LevelCodes] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Packed:
    """Uniform codes of h heads laid along the batch as attention lays its queries (row j*h + i:
    sequence j, head i), read as a part of shape (b, h, n, d) ((b, n, d) for one head before
    `unsqueeze(1)`).

    codes (b*h, n, w) uint8; scale, zero (b*h, rows, d / dg) float16, as the codec stores them
    (read in place, never copied to float32), token t reading row t // tg, or with `counts`
    ((b*h, rows) int16: what each group holds after evictions) the row whose run holds t;
    channel c reading column c // dg."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    counts: torch.Tensor | None
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
        at = torch.arange(n)
        if self.counts is None:
            rows = (at // self.tg).expand(hb, n)
        else:  # the first row whose run ends past t
            ends = self.counts.long().cumsum(1)
            rows = torch.searchsorted(ends, at.expand(hb, n).contiguous(), right=True).clamp(max=ends.shape[1] - 1)
        scale = gather_rows(self.scale.float(), rows).unsqueeze(-1)
        zero = gather_rows(self.zero.float(), rows).unsqueeze(-1)
        x = (codes * scale + zero).view(self.b, self.h, n, self.dim)
        return x[:, 0] if self.one_head else x

    def reads(self, enc: Encoded) -> bool:
        """True when this part reads `enc`'s own tensors (nothing was stacked, converted or copied)."""
        meta = enc.tokens if enc.codec.axis == "token" else enc.groups  # type: ignore[attr-defined]
        mine, theirs = [self.codes, self.scale, self.zero], [enc.tokens["codes"], meta["scale"], meta["zero"]]
        if self.counts is not None:
            mine, theirs = [*mine, self.counts], [*theirs, enc.groups["count"]]
        return all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in zip(mine, theirs, strict=True))

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
        rows, n = ctypes.c_int64(self.codes.shape[0]), ctypes.c_int64(self.codes.shape[1])
        w, bits, *layout = self.arguments
        getattr(lib, name)(
            rows, n, ctypes.c_int64(self.dim), w, bits, *layout,
            pointer(x), ctypes.c_int64(x.shape[1]), pointer(out), ctypes.c_int(torch.get_num_threads()),
        )  # fmt: skip

    @cached_property
    def arguments(self) -> tuple[object, ...]:
        """The kernel's arguments that describe these codes (width, bits, pointers, groups), made
        once: a head's part is read again at every decoding step."""
        i64 = ctypes.c_int64
        counts = pointer(self.counts) if self.counts is not None else None
        return (
            i64(self.codes.shape[2]), ctypes.c_int(self.bits),
            pointer(self.codes), pointer(self.scale), pointer(self.zero),
            i64(self.scale.shape[1]), i64(self.tg), i64(self.dg), counts,
        )  # fmt: skip


PLAIN_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # dtype codes of packed_attend


def attend_head(query: torch.Tensor, keys: list[Any], values: list[Any], scale: float) -> torch.Tensor | None:
    """(b, g, q, d) float32: one KV head's queries (b, g, q, d) attending, with no mask, its coded
    tokens then its newest ones held plain (keys, values: [one-head `Packed` (b, n, d), tensor
    (b, m, d)], as `head_parts` hands them), in one kernel call (`packed_attend`: logits,
    softmax and mix); None where that call does not apply, and `few_queries` reads the parts."""
    if len(keys) != 2 or len(values) != 2:
        return None
    (kc, kp), (vc, vp) = keys, values
    if not isinstance(kc, Packed) or not isinstance(vc, Packed) or not kc.one_head or not vc.one_head:
        return None
    b, g, q, d = query.shape
    kind = PLAIN_KINDS.get(kp.dtype)
    if kind is None or vp.dtype != kp.dtype or kp.shape[0] != b or vp.shape[0] != b or kc.b != b or vc.b != b:
        return None
    if kc.dim != d or vc.dim != d or kc.codes.shape[1] != vc.codes.shape[1] or kp.shape[1] != vp.shape[1]:
        return None
    if kp.stride(-1) != 1 or vp.stride(-1) != 1 or kp.device.type != "cpu" or query.device.type != "cpu":
        return None
    lib = library("packed")
    assert lib is not None  # a Packed part exists only where the kernel does
    flat = query.reshape(b, g * q, d).float().contiguous()
    out = torch.empty(b, g * q, d, dtype=torch.float32)
    i64 = ctypes.c_int64
    lib.packed_attend(
        i64(b), i64(g * q), i64(d), i64(kc.codes.shape[1]), *kc.arguments, *vc.arguments,
        i64(kp.shape[1]), pointer(kp), i64(kp.stride(0)), i64(kp.stride(1)),
        pointer(vp), i64(vp.stride(0)), i64(vp.stride(1)),
        ctypes.c_int(kind), pointer(flat), ctypes.c_float(scale), pointer(out), ctypes.c_int(torch.get_num_threads()),
    )  # fmt: skip
    return out.view(b, g, q, d)


def packed(parts: list[Encoded], one_head: bool = False) -> Packed | LevelCodes | None:
    """The parts of h heads (alike: one rule, the same shapes) as one part a kernel reads: codes
    on uniform levels (`Packed`) or on a table of levels (`LevelCodes`), read as (b, h, n, d), or
    as (b, n, d) for `one_head`; None where no kernel applies (then they are decoded). One head's
    part reads its own tensors in place, so it is kept beside the part (`Encoded` parts never
    change once made) and the next decoding step takes it as it is."""
    kept = _KEPT.get(parts[0]) if len(parts) == 1 else None
    if kept is not None:  # made where the kernel is: read by it while the part lives
        return kept if kept.one_head == one_head else replace(kept, one_head=one_head)
    part = _packed(parts, one_head) if type(parts[0].codec) is Uniform else level_codes(parts, one_head)
    if part is not None and len(parts) == 1 and part.reads(parts[0]):
        _KEPT[parts[0]] = part  # views of the part's own CPU tensors: no byte more is held
    return part


def _packed(parts: list[Encoded], one_head: bool) -> Packed | None:
    first = parts[0]
    codec = first.codec
    if type(codec) is not Uniform or codec.bits not in (1, 2, 4, 8) or first.n == 0:
        return None
    per = 8 // codec.bits  # codes to a byte: a token's bytes come in 16s, a channel group in whole bytes
    if packed_size(first.dim, codec.bits) % LANES or first.dim % per or codec.axis == "token" and codec.group % per:
        return None
    if first.tokens["codes"].device.type != "cpu" or library("packed") is None:
        return None
    meta = [p.tokens if codec.axis == "token" else p.groups for p in parts]
    if any(m["scale"].dtype != torch.float16 or m["zero"].dtype != torch.float16 for m in meta):
        return None  # the kernel reads float16 metadata (`encoded.META_DTYPE`)
    codes = stack_heads([p.tokens["codes"] for p in parts])
    if codec.axis == "token":
        tg, dg, counts = 1, codec.group, None
    else:
        tg, dg = codec.group, 1
        counts = stack_heads([p.groups["count"] for p in parts]).contiguous() if "count" in first.groups else None
    scale = stack_heads([m["scale"] for m in meta]).contiguous()
    zero = stack_heads([m["zero"] for m in meta]).contiguous()
    b, h = codes.shape[0] // len(parts), len(parts)
    if counts is not None and counts.dtype != torch.int16:
        counts = counts.to(torch.int16)
    return Packed(codes.contiguous(), scale, zero, counts, codec.bits, tg, dg, first.dim, b, h, one_head)
