"""Budgets: how many bytes the cache may hold, resolved to tokens per head by pure functions.

`0.25` is a fraction of the full cache's bytes (it follows the sequence as it grows, so the
ratio holds at every step); `512t` is a fixed number of tokens per KV head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstack.errors import UserError


@dataclass(frozen=True)
class Budget:
    """A cache budget: `fraction` of the full cache's bytes, or `tokens` per KV head."""

    fraction: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.tokens is None):
            raise UserError("a budget is either a fraction like 0.25 or a token count like 512t")
        if self.fraction is not None and not (0.0 < self.fraction <= 1.0):
            raise UserError(f"budget {self.fraction} is out of range: a fraction must be in (0, 1]")
        if self.tokens is not None and self.tokens < 1:
            raise UserError(f"budget {self.tokens}t is out of range: keep at least 1 token per head")

    @classmethod
    def parse(cls, text: str | float | int | Budget) -> Budget:
        """Parse `0.25` (fraction of full bytes) or `512t` (tokens per head)."""
        if isinstance(text, Budget):
            return text
        raw = str(text).strip().lower()
        if raw.endswith("t"):
            try:
                return cls(tokens=int(raw[:-1]))
            except ValueError:
                raise UserError(f"budget '{text}' is not a token count: write e.g. 512t") from None
        try:
            value = float(raw)
        except ValueError:
            raise UserError(
                f"budget '{text}' is not understood: write a fraction in (0, 1] like 0.25 "
                "or a token count per head like 512t"
            ) from None
        if math.isnan(value):
            raise UserError("budget NaN is out of range: a fraction must be in (0, 1]")
        return cls(fraction=value)

    @property
    def is_full(self) -> bool:
        """True when nothing is ever evicted (fraction 1.0)."""
        return self.fraction is not None and self.fraction >= 1.0

    def __str__(self) -> str:
        return f"{self.tokens}t" if self.tokens is not None else f"{self.fraction:g}"


def tokens_to_keep(budget: Budget, n_full: torch.Tensor, full_token_bytes: int, token_bytes: int) -> torch.Tensor:
    """Tokens each head may keep so that its bytes stay within budget.

    n_full: (...) tokens a full cache would hold for this head; full_token_bytes: bytes a full
    cache spends per token and head (K and V); token_bytes: what the compressed storage spends
    (K, V and the position index). Returns a tensor shaped like n_full, never above it.
    """
    if budget.is_full:
        return n_full.clone()
    if budget.tokens is not None:
        return torch.clamp(n_full, max=budget.tokens)
    assert budget.fraction is not None
    allowed = torch.floor(n_full.double() * budget.fraction * full_token_bytes / token_bytes).long()
    return torch.minimum(allowed, n_full)
