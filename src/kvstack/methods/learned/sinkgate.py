"""`sinkgate`: Fast KVzip's sink-attention gates, KVzip's scores from one token (#44, arXiv 2601.17668)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstack.methods.base import Observation, recent_mask
from kvstack.methods.learned.scorer import LearnedScorer
from kvstack.methods.registry import register


@register
@dataclass
class SinkGate(LearnedScorer):
    """Fast KVzip (#44): a lightweight gate per layer predicts KVzip's score of each token from that
    token alone, at prefill and while decoding, and the cache keeps the highest-gated tokens of the
    budget. The gate is a low-rank sink attention (`sink_attention`): the token's own low-rank key
    and its query heads' low-rank queries, against 16 learned sink keys; its output, the share of
    attention the token keeps against the sinks, lies in (0, 1) as KVzip's score does. The newest
    `window` share of each head's tokens is always kept (the paper's local window, 2% of the
    context), and the first `sinks` tokens.

    What is trained, on what: the gates alone, beside the frozen model, on KVzip's scores of State
    of the Union addresses (no benchmark text) by binary cross-entropy (`kvstack train sinkgate`;
    the paper's objective); forward passes of the model only, no backpropagation through it.

    Deviations from the paper: its gate reads the layer's hidden state (D wide); here it reads the
    token's key before RoPE and its value, each over its RMS (2d per head, a linear image of that
    hidden state that the cache already holds), so nothing is hooked into the model. Its teacher
    is KVzip as the paper defines it, on long instruction data; here KVzip's score as kvstack
    computes it, on 16 rows of 1,024 tokens by default. Adam with a cosine schedule replaces its
    SGD. The paper evicts by one top-k over every layer and head (kvpress's `layerwise=False`);
    alone, `sinkgate` keeps each head's share of the byte budget, and `globalk(sinkgate)` evicts as
    the paper does (its gates are probabilities, one scale for every head).

    Parameters: `window` the newest share of each head's held tokens always kept (0.02);
    `path` a gate file; `sinks` first tokens always kept.
    Shapes: keys, values (b, h, t, d) -> gate inputs (b, h, t, 2d) -> log gate (b, h, t).
    """

    name = "sinkgate"
    paper = "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction (#44, arXiv 2601.17668)"
    window: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.window < 1:
            raise ValueError(f"sinkgate: window must be in [0, 1) (the newest share always kept), got {self.window}")

    def score(self, obs: Observation) -> torch.Tensor:
        gate = self.predicted(obs)
        if self.window:
            newest = (obs.valid.sum(-1) * self.window).ceil().long()  # (b, h) tokens in each head's window
            gate = torch.where(recent_mask(obs, newest), torch.full_like(gate, math.inf), gate)
        return self.keep_sinks(obs, gate)
