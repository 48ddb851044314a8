"""Bit packing: integer codes below 2**bits stored `8 / bits` to a byte, so memory really drops.

Pure functions on uint8 tensors. Widths that divide 8 (1, 2, 4, 8) pack with shifts; 3 bits
packs eight codes into three bytes through bit planes: code i holds bits 3i..3i+2 of the row's
little-endian bit stream, so each three bytes read as one 24-bit word give eight codes by
shifts (`unpack`). The last axis is packed.
"""

from __future__ import annotations

import sys

import torch

from kvstack.errors import UserError

BIT_WIDTHS = (1, 2, 3, 4, 8)


def check_bits(bits: int, who: str) -> None:
    """One-line error for a bit width kvstack cannot pack."""
    if bits not in BIT_WIDTHS:
        widths = ", ".join(map(str, BIT_WIDTHS))
        raise UserError(f"{who}: {bits}-bit codes are not supported: use one of {widths}")


def packed_size(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits take once packed."""
    return (n * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) integer codes in [0, 2**bits) -> (..., ceil(n * bits / 8)) uint8."""
    codes = codes.to(torch.uint8)
    n = codes.shape[-1]
    if bits == 8:
        return codes.contiguous()
    per_byte = 8 // bits if 8 % bits == 0 else 0
    if per_byte:
        pad = (-n) % per_byte
        if pad:
            codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
        grouped = codes.reshape(*codes.shape[:-1], -1, per_byte).to(torch.int32)
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
        return (grouped << shifts).sum(-1).to(torch.uint8)
    planes = (codes.unsqueeze(-1).to(torch.int32) >> torch.arange(bits, device=codes.device, dtype=torch.int32)) & 1
    flat = planes.reshape(*codes.shape[:-1], n * bits)
    pad = (-flat.shape[-1]) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(*flat.shape[:-1], pad)], dim=-1)
    octets = flat.reshape(*flat.shape[:-1], -1, 8)
    return (octets << torch.arange(8, device=codes.device, dtype=torch.int32)).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack`: (..., ceil(n * bits / 8)) uint8 -> (..., n) uint8 codes."""
    if bits == 8:
        return packed[..., :n]
    mask = (1 << bits) - 1
    if 8 % bits == 0:  # shifts on the bytes themselves: the decoding hot path
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*packed.shape[:-1], -1)[..., :n]
    if bits == 3:  # eight codes per three bytes: one 24-bit word, eight shifts
        shifts = torch.arange(0, 24, 3, device=packed.device, dtype=torch.int32)
        codes = (_words3(packed).unsqueeze(-1) >> shifts) & mask  # (..., bytes / 3, 8)
        return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)
    as_int = packed.to(torch.int32)  # other widths (cq's codes of several channels): bit planes
    flat = ((as_int.unsqueeze(-1) >> torch.arange(8, device=packed.device, dtype=torch.int32)) & 1).reshape(
        *packed.shape[:-1], -1
    )
    planes = flat[..., : n * bits].reshape(*packed.shape[:-1], n, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (planes * weights).sum(-1).to(torch.uint8)


def _words3(packed: torch.Tensor) -> torch.Tensor:
    """(..., ceil(bytes / 3)) int32: each three bytes of 3-bit codes (..., bytes) as one 24-bit
    little-endian word holding eight codes, the last padded with zero bytes."""
    pad = (-packed.shape[-1]) % 3
    if pad:
        packed = torch.cat([packed, packed.new_zeros(*packed.shape[:-1], pad)], dim=-1)
    b = packed.reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}
_SHIFTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def unpack_float(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """`unpack` straight to float32: (..., ceil(n * bits / 8)) uint8 -> (..., n) float32, a new
    tensor the caller may write in place.

    Widths that divide 8 shift whole 32-bit words when a row's bytes come in fours (a head of 64
    channels at 1, 2 or 4 bits): one shift, one mask and one conversion over int32 lanes, ~2x
    faster on the decoding hot path than reading each byte's codes from a 256-row table, the
    fallback for other rows."""
    if bits == 8 or 8 % bits:
        return unpack(packed, bits, n).float()
    width, key = packed.shape[-1], (bits, packed.device)
    if width % 4 == 0 and sys.byteorder == "little":  # byte k of a word sits at bits 8k..8k+7
        shifts = _SHIFTS.get(key)
        if shifts is None:
            shifts = _SHIFTS[key] = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
        packed = packed.contiguous()
        if packed.storage_offset() % 4:  # a word view must start on a word
            packed = packed.clone()
        words = packed.view(torch.int32)  # (..., width / 4)
        codes = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).float()  # (..., width / 4, 32 / bits)
        return codes.reshape(*packed.shape[:-1], width * 8 // bits)[..., :n]
    table = _TABLES.get(key)
    if table is None:
        shifts = torch.arange(0, 8, bits, device=packed.device)
        table = _TABLES[key] = (
            (torch.arange(256, device=packed.device)[:, None] >> shifts) & ((1 << bits) - 1)
        ).float()
    codes = torch.nn.functional.embedding(packed.int(), table)  # (..., bytes, 8 // bits)
    return codes.reshape(*packed.shape[:-1], width * 8 // bits)[..., :n]


def chunk_bits(bits: int) -> int:
    """Bits read per table lookup by `lookup`: whole codes, 12 for 3-bit codes (four per lookup,
    two per 24-bit word), else a byte."""
    return 12 if bits == 3 else 8


def chunk_table(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """(2^c, c / bits) float32: for every chunk of c = `chunk_bits` bits, the levels (2^bits,) of
    its codes in order, so `lookup` turns packed codes into values with one gather per chunk."""
    c = chunk_bits(bits)
    shifts = torch.arange(0, c, bits, device=levels.device)
    codes = (torch.arange(2**c, device=levels.device)[:, None] >> shifts) & ((1 << bits) - 1)
    return levels.float()[codes]


def lookup(packed: torch.Tensor, bits: int, n: int, table: torch.Tensor) -> torch.Tensor:
    """levels[unpack(packed, bits, n)] as (..., n) float32, from `chunk_table(levels, bits)`: each
    chunk of whole codes indexes the table once (no per-code index tensor, no separate gather)."""
    if bits == 3:
        word = _words3(packed)  # (..., bytes / 3): eight codes
        index = torch.stack([word & 0xFFF, word >> 12], dim=-1)  # (..., bytes / 3, 2): four codes each
    else:
        index = packed.int()  # a byte: 8 / bits codes (one at 8 bits)
    values = torch.nn.functional.embedding(index, table)
    return values.reshape(*packed.shape[:-1], -1)[..., :n]
