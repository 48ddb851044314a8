"""A head's tokens held encoded (`Coded`: keys and values as codes), and the helpers that read
several heads' codes at once or pick tokens out of them in order."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvstack.cache.encoded import Encoded, Turned


@dataclass(eq=False)
class Coded:
    """Tokens of one head held encoded (keys and values), and whether a selection demoted them to
    low precision instead of evicting them (MiKV)."""

    keys: Encoded
    values: Encoded
    demoted: bool = False

    @property
    def n(self) -> int:
        return self.keys.n

    def take(self, index: torch.Tensor) -> Coded:
        return Coded(self.keys.take(index), self.values.take(index), self.demoted)

    def cat(self, other: Coded) -> Coded:
        return Coded(self.keys.cat(other.keys), self.values.cat(other.values), self.demoted)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.tensors(), *self.values.tensors()]


def alike(a: Encoded, b: Encoded) -> bool:
    """True when two heads' parts can be decoded as one batch: the same rule that reads no
    per-head table (`Codec.batchable`), the same tensors' shapes."""
    if not (a.codec.batchable and a.codec.same(b.codec)) or a.n != b.n or a.dtype != b.dtype:
        return False
    rule = a.shared.keys() == b.shared.keys() and all(a.shared[k] is b.shared[k] for k in a.shared)
    shapes = {k: v.shape for k, v in a.tokens.items()}, {k: v.shape for k, v in a.groups.items()}
    return rule and shapes == ({k: v.shape for k, v in b.tokens.items()}, {k: v.shape for k, v in b.groups.items()})


def decode_heads(parts: list[Encoded], dtype: torch.dtype) -> torch.Tensor | Turned:
    """(b, h, n, d) in `dtype`: the parts of h heads (each (b, n, d) once decoded) decoded in one
    call, the heads laid along the batch (`alike` parts only); `Turned` when the codec keeps its
    tokens on a rotated basis (`Encoded.read`)."""
    first, h = parts[0], len(parts)
    batched = replace(
        first,
        tokens={k: torch.cat([p.tokens[k] for p in parts]) for k in first.tokens},
        groups={k: torch.cat([p.groups[k] for p in parts]) for k in first.groups},
    )
    out = batched.read(dtype)  # (h*b, n, d)
    if isinstance(out, Turned):
        return Turned(out.y.view(h, -1, *out.y.shape[1:]).transpose(0, 1), out.basis)
    return out.view(h, -1, *out.shape[1:]).transpose(0, 1)


def compact(positions: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the entries of positions (b, k) where mask holds, moved to the front in order:
    (picked (b, k'), real (b, k')), k' the most any row picks; rows with fewer repeat their last
    pick (0 when none), so each row stays in the order of `positions`."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    count = mask.sum(1)
    k = int(count.max().item()) if count.numel() else 0
    picked = torch.gather(positions, 1, order)[:, :k]
    real = torch.arange(k, device=positions.device) < count.unsqueeze(1)
    if k == 0:
        return picked, real
    last = torch.gather(picked, 1, (count - 1).clamp(min=0).unsqueeze(1))
    last = torch.where(count.unsqueeze(1) > 0, last, torch.zeros_like(last))
    return torch.where(real, picked, last.expand_as(picked)), real
