"""`vatp`: Value-Aware Token Pruning (Guo et al., EMNLP 2024, arXiv 2406.12335): attention x value norm."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Method, Observation
from kvstack.methods.evict.rescore import Rescorer
from kvstack.methods.registry import register


def value_l1(values: torch.Tensor) -> torch.Tensor:
    """(b, h, t) L1 norm of each token's value vector, from values (b, h, t, d)."""
    return values.float().abs().sum(dim=-1)


@register
@dataclass
class VATP(Rescorer):
    """ "Attention Score is not All You Need for Token Importance": a token's contribution to the
    attention output is its attention weight times its value vector, so VATP ranks tokens by the
    inner scorer's attention-based score times the L1 norm of the token's value (per KV head,
    ||v||_1 over d). Attention sinks draw much attention but carry tiny values; the paper keeps
    the first `sinks` tokens outright (+inf) so the value term does not drop them.

    Parameters: `scorer` the attention-based importance to re-weight (default h2o, the paper's
    accumulated attention; any scorer composes: `vatp(snapkv(window_size=32))`); `sinks` first
    tokens always kept, default 4 (our choice: the reference code, github.com/guozhiyu/vatp
    utils_hh/modify_llama.py, sets them with `sink_len`, a command-line value, 20 in its example).
    +inf scores of the inner scorer (its recent window) stay +inf.

    Shapes: inner scores (b, h, t) x value_l1(values (b, h, t, d)) -> scores (b, h, t).
    """

    name = "vatp"
    family = "evict"
    paper = (
        "Attention Score is not All You Need for Token Importance Indicator in KV Cache Reduction (arXiv 2406.12335)"
    )
    needs = frozenset({"attention_sum"})  # h2o's, the default inner scorer
    scorer: Method = field(default_factory=lambda: default_scorer("h2o"))
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"vatp: sinks must be >= 0 (first tokens always kept), got {self.sinks}")

    @property
    def min_tokens(self) -> int:
        return max(self.scorer.min_tokens, self.sinks)

    def score(self, obs: Observation) -> torch.Tensor:
        inner = self.scorer.score(obs).float()
        scores = inner * value_l1(obs.values)
        keep = torch.isposinf(inner) | (obs.valid & (obs.positions < self.sinks))
        return torch.where(keep, torch.full_like(scores, float("inf")), scores)
