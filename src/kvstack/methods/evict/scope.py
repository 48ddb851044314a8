"""`scope`: SCOPE (Wu et al., arXiv 2412.13649): compress the prefill and the decoding separately.

Reference code read: github.com/Linking-ai/SCOPE, model/kv_utils.py (`update_kv` for the prefill,
`update_kv_in_decoding` for the decoding strategies "slide", "adaptive", "discontinuous").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Method, Observation, recent_mask
from kvstack.methods.evict.rescore import Rescorer
from kvstack.methods.registry import register


@register
@dataclass
class SCOPE(Rescorer):
    """SCOPE, "Optimizing Key-Value Cache Compression in Long-context Generation": a prompt-time
    method (SnapKV, PyramidKV, ...) is tuned for the prefill, yet in long outputs the heavy hitters
    of the decoding phase are different tokens; SCOPE compresses the two phases separately. At
    prefill the wrapped `scorer` decides alone. While decoding, the prompt's compressed cache is
    frozen (never evicted again: slots < prompt_end score +inf) and only the tokens generated so
    far compete, by the current query's attention (`last_attention`, the reference's one-query
    `attn_weights`), the newest `recent` of them first.

    Budget: the cache's total (a fraction of the full cache, as everywhere in kvstack). The prompt's
    share was spent at prefill; the decoding tokens get what the budget grows by as they arrive,
    which is the reference's "adaptive" strategy (a decoding window that grows with the steps).
    "slide" re-selects at every step (`every` = 1, the default); "discontinuous" re-selects every
    delta steps (`every` = delta, the reference's delta = 15), evicting ahead so the steps between fit.

    Parameters: `scorer` the prefill method, default snapkv (the reference pairs SCOPE with
    SnapKV, PyramidKV, H2O, StreamingLLM); `recent` = 8, the decoding tokens ranked first (newest
    first), the reference's decoding_recent_size r: 256 of a 512-token decoding window, half of it.
    kvstack's answers are ~32 tokens, so at budget 0.5 about 16 decoding tokens are held; half, 8,
    is the same split. The recent window ranks under the frozen prompt (scores 2 + position, above
    any attention in [0, 1]): early on, when the grown budget holds fewer decoding tokens than
    `recent`, the newest of them stay and the prompt is untouched. The cache's own `decode_window`
    would outrank the prompt and evict it, so it is 0 here by default. While decoding the cache
    follows scope's own `every` and `decode_window`, not the wrapped scorer's (it acts at prefill).

    Shapes: last_attention, slots, positions (b, h, t) -> scores (b, h, t).
    """

    name = "scope"
    family = "evict"
    paper = "SCOPE: Optimizing Key-Value Cache Compression in Long-context Generation (arXiv 2412.13649)"
    needs = frozenset({"last_attention"})  # snapkv, the default prefill scorer, needs only queries
    cadence_from_inner = False  # decodes at its own cadence: the wrapped scorer acts at prefill
    scorer: Method = field(default_factory=lambda: default_scorer("snapkv"))
    recent: int = 8
    every: int = field(default=1, kw_only=True)  # "slide": the paper re-selects at every step
    decode_window: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 0:
            raise ValueError(f"scope: recent must be >= 0 (newest decoding tokens ranked first), got {self.recent}")

    def limit(self, keep: torch.Tensor, decoding: bool, confidence: torch.Tensor | None) -> torch.Tensor:
        return keep if decoding else self.scorer.limit(keep, decoding, confidence)

    def score(self, obs: Observation) -> torch.Tensor:
        if not obs.decoding:
            return self.scorer.score(obs)
        scores = obs.last_attention.float()  # in [0, 1]
        scores = torch.where(recent_mask(obs, self.recent), 2.0 + obs.positions.float(), scores)
        frozen = obs.valid & (obs.slots < obs.prompt_end)  # the prompt's cache, compressed at prefill
        return torch.where(frozen, torch.full_like(scores, float("inf")), scores)
