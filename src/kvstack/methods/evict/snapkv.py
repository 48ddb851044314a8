"""`snapkv`: SnapKV (Li et al., 2024): an observation window of recent queries votes for tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.base import Method, Observation, recent_mask
from kvstack.methods.evict.window import smooth, window_votes
from kvstack.methods.registry import register


@register
@dataclass
class SnapKV(Method):
    """The last `window_size` queries attend to all held keys; their attention, summed over the
    window and averaged over the head's query group, is smoothed by 1D average pooling of width
    `kernel_size`. The window's own tokens are always kept. Defaults follow the authors' code
    (window 64 is kvpress's; kernel 5, average pooling). While decoding it re-scores every
    `every` steps with the newest queries as the window.

    Shapes: queries (b, h*g, w, d), keys (b, h, t, d) -> scores (b, h, t).
    """

    name = "snapkv"
    family = "evict"
    paper = "SnapKV: LLM Knows What You are Looking for Before Generation (arXiv 2404.14469)"
    window_size: int = 64
    kernel_size: int = 5
    every: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size < 1:
            raise ValueError(f"{self.name}: window_size must be >= 1, got {self.window_size}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"{self.name}: kernel_size must be odd and >= 1, got {self.kernel_size}")

    @property
    def query_window(self) -> int:
        return self.window_size

    @property
    def min_tokens(self) -> int:
        return self.window_size

    def votes(self, obs: Observation) -> torch.Tensor:
        """(b, h, t) the window's attention to each held token, each query seeing the tokens before it."""
        q_slots = obs.query_slots.repeat(obs.groups)  # (g*w,) in the order window_votes flattens queries
        allowed = obs.valid[:, :, None, :] & (obs.slots[:, :, None, :] <= q_slots[None, None, :, None])
        return window_votes(obs.queries, obs, allowed)

    def score(self, obs: Observation) -> torch.Tensor:
        pooled = smooth(self.votes(obs), self.kernel_size, obs.valid)
        window = recent_mask(obs, obs.queries.shape[2])
        return torch.where(window, torch.full_like(pooled, float("inf")), pooled)
