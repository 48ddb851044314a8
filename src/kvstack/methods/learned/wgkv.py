"""`wgkv`: Write-Gated KV, KV admission by a learned gate read once per token (#38, arXiv 2512.17452)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Observation, recent_mask
from kvstack.methods.learned.scorer import LearnedScorer
from kvstack.methods.registry import register


@register
@dataclass
class WGKV(LearnedScorer):
    """Write-Gated KV (#38): a lightweight gate per KV head predicts, from a token alone as it is
    written, whether it will be worth keeping. Every token first goes to a local cache of the
    newest `window` tokens, which attention always reads; as it leaves that window the gate decides
    whether it is admitted to the global cache or dropped for good. Because the gate reads nothing
    but the token (its key before RoPE and its value, each over its RMS), a token's gate never
    changes once written: the decision taken when it left the window stands, and a token dropped
    then is never stored again.

    What is trained, on what: per layer and KV head a small predictor (`kvstack train wgkv`: the
    paper's 2-layer MLP, 32 wide, which ships for SmolLM2; `--hidden 0` a linear gate) fitted to the
    log of KVzip's reconstruction score on State of the Union addresses (no benchmark text);
    `--teacher future` fits it to the attention of the next 128 tokens instead. On SmolLM2 it
    keeps the continuation (fidelity above kvzap's) and loses most needles: a token alone does
    not say it is a fact (README, write-gated admission).

    Deviations from the paper: its gate is trained end to end, the log gate added to the attention
    logits of the tokens outside the local window and the output distilled to the full model's,
    with a sparsity penalty; here it is fitted (ridge, exactly) to KVzip's score. The paper admits
    a token when its gate passes a threshold, so memory follows the text; here the byte budget
    decides: the global cache holds the best-gated tokens that fit, and a better-gated newcomer
    displaces the worst (the eviction the paper composes admission with). Its prefill attends
    only the local window and the admitted tokens; kvstack's prefill attends the whole prompt and
    then admits (`kvstack generate --prefill-chunk N` brings it closer: each chunk is admitted
    before the next is read).

    Parameters: `window` newest tokens always held (the local cache; a budget below sinks +
    window is spent on those tokens alone); `path` a predictor file; `sinks` first tokens always
    kept.
    Shapes: keys, values (b, h, t, d) -> gate inputs (b, h, t, 2d) -> scores (b, h, t).
    """

    name = "wgkv"
    paper = "Write-Gated KV, KV Admission: Learning What to Write (#38, arXiv 2512.17452)"
    window: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 0:
            raise ValueError(f"wgkv: window must be >= 0 (newest tokens always held), got {self.window}")

    def score(self, obs: Observation) -> torch.Tensor:
        gate = self.predicted(obs)
        if self.window:
            gate = torch.where(recent_mask(obs, self.window), torch.full_like(gate, float("inf")), gate)
        return self.keep_sinks(obs, gate)
