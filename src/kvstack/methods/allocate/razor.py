"""`razor`: RazorAttention (Tang et al., 2024): retrieval heads keep the whole cache, the others a few tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.allocate.calibrated import Calibrated
from kvstack.methods.base import Stage
from kvstack.methods.registry import register

RETRIEVAL_WEIGHT = 1e4  # far above any room / base ratio: distribute caps these heads at their room first


def top_heads(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """(L, h) bool: the round(fraction x L x h) highest scores over all heads (ties: lower index)."""
    count = round(fraction * scores.numel())
    chosen = torch.zeros(scores.numel(), dtype=torch.bool)
    chosen[torch.sort(scores.flatten(), descending=True, stable=True).indices[:count]] = True
    return chosen.view(scores.shape)


def retrieval_heads(
    echo: torch.Tensor, induction: torch.Tensor, induction_frac: float, echo_frac: float
) -> torch.Tensor:
    """(L, h) bool: RazorAttention's retrieval heads, the top `induction_frac` of heads by induction
    score united with the top `echo_frac` by echo score. echo, induction: (L, h)."""
    return top_heads(induction, induction_frac) | top_heads(echo, echo_frac)


@register
@dataclass
class Razor(Calibrated):
    """RazorAttention: "only a fraction of attention heads, namely retrieval heads, can attend to
    all input tokens [...] other heads primarily focus on local context and attention sinks":
    retrieval heads keep the whole cache, the others share what is left of the budget and keep
    what their `scorer` picks (StreamingLLM's sinks + recent window by default, as in the paper;
    `razor(knorm)` etc.).

    Retrieval heads are found once per model (`kvstack.calibrate.heads.razor_scores`): on a random
    segment repeated 4 times, a query head's echo score is its mean attention to the earlier copy
    of the current token, its induction score to the token after that copy; a KV head takes the
    max over its query group. Retrieval heads: the top `induction` (0.14) fraction of all KV heads
    by induction score, united with the top `echo` (0.01) by echo score (defaults of the reference,
    mindspore-ai/golden-stick ra_config.py; counts rounded as in its razor_attention.py, so a model
    with at most 50 KV heads has no echo head). Their weight is so large that `distribute` gives
    them their whole room first; if they cannot all fit the budget they share it in proportion to
    their uniform shares, and the other heads keep their scorer's minimum.

    Deviations: the reference repeats 2500 random ids (here min(256, max_position_embeddings / 8),
    enough to tell the heads apart at a fraction of the cost) and gives the non-retrieval heads a
    fixed 4 sinks + 256 recent tokens (here: whatever the budget leaves them).

    Compensation token (`compensate`, on by default): what a head evicts is averaged into one
    extra token of that head (keys post-RoPE and values, a running mean over everything it has
    evicted, at the slot of its first evicted token), inside the budget; attention treats it as an
    ordinary token, as the reference code does (wrappers/vllm_mindspore attention_wrappers.py,
    `_compress`); the count-weighted form of the paper's equation is left to merging, which adds
    per-token weights to the cache. Retrieval heads keep everything, so only the others fold.

    Shapes: calibration table (2, L, h_kv) (echo, induction); weights (L, b, h_kv).
    """

    name = "razor"
    paper = "RazorAttention: Efficient KV Cache Compression Through Retrieval Heads (arXiv 2407.15891)"
    scorer: Stage = field(default_factory=lambda: default_scorer("streaming"))
    induction: float = 0.14
    echo: float = 0.01
    compensate: bool = True

    @property
    def roles(self) -> frozenset[str]:
        """An allocator, and a folder while it keeps a compensation token."""
        return super().roles | ({"folder"} if self.compensate else set())

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("induction", "echo"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"razor: {key} must be in [0, 1] (a fraction of all heads), got {value}")

    def measure(self, model: Any) -> torch.Tensor:
        from kvstack.calibrate.heads import razor_scores

        return razor_scores(model)

    def head_weights(self, table: torch.Tensor) -> torch.Tensor:
        retrieval = retrieval_heads(table[0], table[1], self.induction, self.echo)
        return torch.where(retrieval, RETRIEVAL_WEIGHT, 1.0).double()
