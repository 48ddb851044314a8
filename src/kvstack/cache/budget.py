"""Budgets: how many bytes the cache may hold, resolved to tokens per head by pure functions.

`0.25` is a fraction of the full cache's bytes (it follows the sequence as it grows, so the
ratio holds at every step); `512t` is a fixed number of tokens per KV head; `64MB` (also `512KB`,
`1.5GB`, `2TB`, `123456B`; powers of 1024) is an absolute number of bytes per sequence, turned into
a fraction of that sequence's context by the cache at every step (`Budget.resolve`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvstack.errors import UserError

MIN_FRACTION = 1e-4  # a smaller fraction keeps nothing of any context a model here reads
MAX_TOKENS = 2**31 - 1
MAX_BYTES = 2**50  # 1024TB
UNITS = " kmgt"  # B, KB, MB, GB, TB: powers of 1024


@dataclass(frozen=True)
class Budget:
    """A cache budget: `fraction` of the full cache's bytes, `tokens` per KV head, or `nbytes` in all."""

    fraction: float | None = None
    tokens: int | None = None
    nbytes: int | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.fraction, self.tokens, self.nbytes)) != 1:
            raise UserError("a budget is either a fraction like 0.25, a token count like 512t or bytes like 64MB")
        if self.nbytes is not None and not 1 <= self.nbytes <= MAX_BYTES:
            raise UserError(f"budget {self.nbytes} bytes is out of range: give a size from 1B to 1024TB, like 64MB")
        if self.fraction is not None and not (MIN_FRACTION <= self.fraction <= 1.0):
            raise UserError(
                f"budget {self.fraction:g} is out of range: a fraction must be in [{MIN_FRACTION:g}, 1] "
                "(or give tokens per head like 64t)"
            )
        if self.tokens is not None and not 1 <= self.tokens <= MAX_TOKENS:
            raise UserError(f"budget {self.tokens}t is out of range: keep 1 to {MAX_TOKENS} tokens per head")

    @classmethod
    def parse(cls, text: str | float | int | Budget) -> Budget:
        """Parse `0.25` (fraction of full bytes), `512t` (tokens per head) or `64MB` (bytes per sequence)."""
        if isinstance(text, Budget):
            return text
        raw = str(text).strip().lower()
        shown = raw if len(raw) <= 40 else f"{raw[:37]}..."
        size = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]?)i?b", raw)
        if size:
            value = float(size.group(1)) * 1024 ** UNITS.index(size.group(2) or " ")
            if not math.isfinite(value) or value > MAX_BYTES:
                raise UserError(f"budget '{shown}' is out of range: give a size up to 1024TB, like 64MB")
            return cls(nbytes=int(value))
        if raw.endswith("t"):
            digits = raw[:-1].strip()
            if not digits.isdigit():
                raise UserError(f"budget '{shown}' is not a token count: write e.g. 512t")
            if len(digits) > 12:
                raise UserError(f"budget '{shown}' is out of range: keep 1 to {MAX_TOKENS} tokens per head")
            return cls(tokens=int(digits))
        try:
            value = float(raw)
        except ValueError:
            raise UserError(
                f"budget '{shown}' is not understood: write a fraction in (0, 1] like 0.25, "
                "a token count per head like 512t or a size like 64MB"
            ) from None
        if not math.isfinite(value):
            raise UserError(f"budget '{shown}' is out of range: a fraction must be in [{MIN_FRACTION:g}, 1]")
        return cls(fraction=value)

    @property
    def is_full(self) -> bool:
        """True when nothing is ever evicted (fraction 1.0)."""
        return self.fraction is not None and self.fraction >= 1.0

    def resolve(self, full_bytes: float) -> Budget:
        """This budget as a fraction of a full cache of `full_bytes` (a byte budget above it is 1.0)."""
        if self.nbytes is None:
            return self
        return Budget(fraction=min(1.0, self.nbytes / full_bytes)) if full_bytes > 0 else Budget(fraction=1.0)

    def __str__(self) -> str:
        if self.nbytes is not None:
            return size_text(self.nbytes, exact=True)
        return f"{self.tokens}t" if self.tokens is not None else _number(self.fraction)


def _number(value: float) -> str:
    """The shortest text that reads back to exactly `value` (`0.25`, `1`, `0.9999999`): budgets are
    store keys, so two budgets never share a label."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def size_text(nbytes: float, exact: bool = False) -> str:
    """`64MB`, `512KB`, `1.5GB` (powers of 1024, 4 significant digits); with `exact`, a text
    `Budget.parse` reads back to the same byte count (`1234567B` when no unit divides it)."""
    for unit, scale in (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if nbytes >= scale and (not exact or (nbytes * 4) % scale == 0):
            return f"{nbytes / scale:.4g}{unit}" if not exact else f"{_number(nbytes / scale)}{unit}"
    return f"{int(nbytes)}B" if exact else f"{nbytes / 1024:.4g}KB"


@dataclass(frozen=True)
class Cost:
    """What one token costs one head, in bytes, by how it is stored (plain data for `tokens_to_keep`).

    full: a full cache's bytes per token (K and V); kept: a kept token once compressed (codes,
    amortised metadata, slot); residual: how many of the newest kept tokens may still be held
    at `residual_bytes` each (a quantizer's full-precision window); dropped: a token the
    selection leaves out (0 when evicted, low-precision bytes when demoted, MiKV); fixed: bytes
    per head that do not grow with tokens (a codebook).
    """

    full: int
    kept: float
    residual: int = 0
    residual_bytes: float = 0.0
    dropped: float = 0.0
    fixed: float = 0.0

    @classmethod
    def table(cls, costs: list) -> Cost:
        """Many heads' costs (a nested list of `Cost`s) as one `Cost` whose fields are float64
        tensors of the list's shape: what `tokens_at_fraction` reads elementwise."""

        def field(x: Any, name: str) -> Any:
            return [field(y, name) for y in x] if isinstance(x, list) else getattr(x, name)

        return cls(**{f.name: torch.tensor(field(costs, f.name), dtype=torch.float64) for f in fields(cls)})


def tokens_to_keep(budget: Budget, n_full: torch.Tensor, cost: Cost) -> torch.Tensor:
    """Tokens each head may keep (the rest evicted, or demoted) so its bytes stay within budget.

    n_full: (...) tokens a full cache would hold for this head. Returns a tensor shaped like
    n_full, never above it. A fraction budget allows `fraction * n_full * cost.full` bytes: the
    newest `cost.residual` kept tokens at `residual_bytes`, the other kept ones at `kept`, the
    others at `dropped`; a token budget counts tokens whatever they cost.
    """
    if budget.is_full:
        return n_full.clone()
    if budget.tokens is not None:
        return torch.clamp(n_full, max=budget.tokens)
    assert budget.fraction is not None
    return tokens_at_fraction(budget.fraction, n_full, cost)


def tokens_at_fraction(fraction: float | torch.Tensor, n_full: torch.Tensor, cost: Cost) -> torch.Tensor:
    """`tokens_to_keep` for a fraction budget, elementwise: `fraction` and the fields of `cost`
    may be float64 tensors broadcasting with n_full (a share and a storage per head: `auto`)."""
    n = n_full.double()
    allowed = n * fraction * cost.full - cost.fixed - n * cost.dropped
    r = torch.minimum(n, torch.as_tensor(cost.residual, dtype=n.dtype))
    with_residual = r + torch.floor((allowed - r * (cost.residual_bytes - cost.dropped)) / (cost.kept - cost.dropped))
    residual_bytes, kept = (torch.as_tensor(x, dtype=n.dtype) for x in (cost.residual_bytes, cost.kept))
    costlier = torch.maximum(residual_bytes, kept)
    within_residual = torch.floor(allowed / (costlier - cost.dropped))
    keep = torch.where(with_residual >= r, with_residual, torch.minimum(within_residual, r))
    return torch.minimum(keep.clamp(min=0).long(), n_full)


def full_precision_room(budget: Budget, n_full: int, cost: Cost) -> float:
    """Tokens a fraction budget pays for at full precision at `n_full` tokens per head, once the
    fixed tables and every token's dropped cost are paid (negative when the tables alone do not fit)."""
    assert budget.fraction is not None
    spare = n_full * (budget.fraction * cost.full - cost.dropped) - cost.fixed
    return spare / (cost.residual_bytes - cost.dropped)


def unaffordable(budget: Budget, n_full: int, cost: Cost) -> str | None:
    """What of a quantizer's fixed cost a fraction budget cannot pay at `n_full` tokens per head:
    "fixed" (codebooks above the whole budget), "residual" (the full-precision window above it,
    while the sequence is longer than the window, so nothing would ever be quantized), or None."""
    if budget.fraction is None or budget.is_full or cost.residual_bytes == 0:
        return None
    if cost.fixed > n_full * (budget.fraction * cost.full - cost.dropped):
        return "fixed"
    if n_full > cost.residual and cost.residual > full_precision_room(budget, n_full, cost):
        return "residual"
    return None
