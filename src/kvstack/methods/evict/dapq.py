"""`dapq`: DapQ (Tian et al., 2026): queries moved to the positions of the coming decoding steps vote."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Observation
from kvstack.methods.evict.snapkv import SnapKV
from kvstack.methods.evict.window import frequencies, steps_to_next, window_votes
from kvstack.methods.registry import register
from kvstack.models.rope import rotate


def pseudo_queries(queries: torch.Tensor, ahead: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(b, h*g, w, d) the observed post-RoPE queries moved to the next w positions, in order.

    Query i (oldest first) lies `ahead[i]` positions before the next token (position T); it moves
    to T + i, the position of the (i+1)-th decoding step: a shift of ahead[i] + i (= w for a
    contiguous window).
    """
    shift = ahead + torch.arange(queries.shape[2], device=ahead.device, dtype=ahead.dtype)
    return rotate(queries.float(), shift, inv_freq)


@register
@dataclass
class DapQ(SnapKV):
    """Decoding-aligned KV cache compression via position-aware pseudo queries (arXiv 2603.11564).

    The paper: "an effective observation window should mirror the decoding-stage queries"; since
    real decoding queries do not exist yet and "positional information plays a more critical role
    than semantic content", it appends N pseudo tokens after the prompt at the positions of the
    first N decoding steps and lets their queries score the cache, SnapKV-style.

    Ours is an approximation without the extra forward pass over pseudo tokens: the last
    `window_size` real post-RoPE queries are rotated (RoPE is a rotation per channel pair, so a
    position shift is one more rotation) to the positions T, T+1, ..., T+w-1 after the newest
    token; their content stays that of the prompt's last tokens, which the paper finds matters
    less than position. No public code: the rest is our SnapKV (float32 softmax over every held
    key, since pseudo queries come after all of them; summed over the w queries, averaged over
    the group, 1D average pooling of width `kernel_size`). Unlike the paper's pseudo tokens, our
    window is real prompt tokens (usually the question), so it is kept (+inf) as SnapKV does.
    While decoding it re-scores every `every` steps with the newest queries, moved ahead likewise.

    Parameters: `window_size` 32 (the paper's default N = 32 pseudo tokens), `kernel_size` 5 and
    `every` 16 (as our snapkv). Shapes: queries (b, h*g, w, d), keys (b, h, t, d) -> (b, h, t).
    """

    name = "dapq"
    paper = (
        "Where Matters More Than What: Decoding-aligned KV Cache Compression via Position-aware "
        "Pseudo Queries (arXiv 2603.11564)"
    )
    window_size: int = 32

    def votes(self, obs: Observation) -> torch.Tensor:
        """(b, h, t) the pseudo queries' attention to each held token; each sees every held token."""
        queries = pseudo_queries(obs.queries, steps_to_next(obs), frequencies(obs, self.name))
        return window_votes(queries, obs, obs.valid[:, :, None, :])
