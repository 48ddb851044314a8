"""Attention read off codes that index a table of levels (`LevelCodes`): TurboQuant's tokens,
norm * levels[code] on a rotated basis. The query is turned once (q R), a small C kernel
(kernels/levels.c) reads each token's levels a chunk at a time from `packing.chunk_table` and
scales by its norm, and the mixed values are turned back once ((sum p y) R^T): no float copy of
the cache. Without the kernel (no compiler, `KVSTACK_KERNELS=0`, a GPU tensor, a head width not
a multiple of 16) parts are decoded by torch as before (`Turned`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from kvstack.cache.encoded import Encoded, LevelForm
from kvstack.cache.kernels import library, pointer, stack_heads
from kvstack.cache.packing import lookup

LANES = 16  # the kernel reads a token's levels as vectors of 16 floats


@dataclass(frozen=True)
class LevelCodes:
    """Level codes of h heads laid along the batch as attention lays its queries (row j*h + i:
    sequence j, head i), read as a part of shape (b, h, n, d) ((b, n, d) for one head before
    `unsqueeze(1)`). codes (b*h, n, w) uint8, norm (b*h, n) float16, as the codec stores them."""

    codes: torch.Tensor
    norm: torch.Tensor
    bits: int
    table: torch.Tensor
    basis: torch.Tensor
    dim: int
    b: int
    h: int
    one_head: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        n = self.codes.shape[1]
        return (self.b, n, self.dim) if self.one_head else (self.b, self.h, n, self.dim)

    def unsqueeze(self, dim: int) -> LevelCodes:
        assert self.one_head and dim == 1, "a coded part only gains its head axis"
        return replace(self, one_head=False)

    def decode(self) -> torch.Tensor:
        """The tokens the codes stand for, float32 (b, h, n, d) ((b, n, d) for one head), in torch:
        what the kernel reads, spelled out (tests check the kernel against it)."""
        y = lookup(self.codes, self.bits, self.dim, self.table) * self.norm.float().unsqueeze(-1)
        x = (y @ self.basis.T).view(self.b, self.h, -1, self.dim)
        return x[:, 0] if self.one_head else x

    def reads(self, enc: Encoded) -> bool:
        """True when this part reads `enc`'s own tensors (nothing was stacked or copied)."""
        form = enc.codec.level_codes(enc)
        assert form is not None
        mine, theirs = (self.codes, self.norm), (form.codes, form.norm)
        return all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in zip(mine, theirs, strict=True))

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        """(b*h, G, n) float32: query (b*h, G, d) float32 times every token's keys."""
        turned = (query.float() @ self.basis).contiguous()  # q R: the tokens stay on their basis
        out = torch.empty(turned.shape[0], turned.shape[1], self.codes.shape[1], dtype=torch.float32)
        self._call("level_logits", turned, out)
        return out

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """(b*h, G, d) float32: probabilities (b*h, G, n) times every token's values."""
        p = probs.float().contiguous()
        out = torch.empty(p.shape[0], p.shape[1], self.dim, dtype=torch.float32)
        self._call("level_mix", p, out)
        return out @ self.basis.T  # (sum p y) R^T: back from the rotated basis once

    def _call(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        lib = library("levels")
        assert lib is not None
        getattr(lib, name)(*self.arguments, pointer(x), ctypes.c_int64(x.shape[1]), pointer(out),
                           ctypes.c_int(torch.get_num_threads()))  # fmt: skip

    @cached_property
    def arguments(self) -> tuple[object, ...]:
        """The kernel's arguments that describe these codes, made once: a head's part is read
        again at every decoding step."""
        i64 = ctypes.c_int64
        rows, n, w = self.codes.shape
        return (
            i64(rows), i64(n), i64(self.dim), i64(w), ctypes.c_int(self.bits),
            pointer(self.codes), pointer(self.norm), pointer(self.table),
        )  # fmt: skip


def level_codes(parts: list[Encoded], one_head: bool) -> LevelCodes | None:
    """The parts of h heads (alike: one rule, the same shapes) as one `LevelCodes` part, or None
    where the kernel does not apply (not level codes, a GPU tensor, no kernel, a width it does
    not read)."""
    first = parts[0]
    forms = [p.codec.level_codes(p) for p in parts]
    if first.n == 0 or first.dim % LANES or any(f is None for f in forms):
        return None
    if forms[0].codes.device.type != "cpu" or library("levels") is None:  # type: ignore[union-attr]
        return None
    ready: list[LevelForm] = [f for f in forms if f is not None]
    codes = stack_heads([f.codes for f in ready]).contiguous()
    norm = stack_heads([f.norm for f in ready]).contiguous()
    if norm.dtype != torch.float16:
        return None  # the kernel reads float16 norms (`encoded.META_DTYPE`)
    head = ready[0]
    table, basis = head.table.float().contiguous(), head.basis.float()
    h = len(parts)
    return LevelCodes(codes, norm, head.bits, table, basis, first.dim, codes.shape[0] // h, h, one_head)
