"""`retention`: learned global retention, each token's utility decaying geometrically with age (#54)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Observation
from kvstack.methods.learned.scorer import LearnedScorer
from kvstack.methods.registry import register


def retained(scale: torch.Tensor, decay: torch.Tensor, age: torch.Tensor) -> torch.Tensor:
    """log utility of a token `age` tokens before the next query: log(gamma * beta^age) with
    log gamma = scale and log beta = decay, a decay above 0 read as none (utility never grows)."""
    return scale + age * decay.clamp(max=0.0)


@register
@dataclass
class Retention(LearnedScorer):
    """Learned global retention (#54): a retention gate gives each token, as it is written, a
    utility gamma and a retention rate beta; its utility `age` tokens later is gamma * beta^age, a
    query-agnostic proxy of the attention future queries will give it. The tokens of lowest
    utility are evicted at prefill and again while decoding, where a token's rank falls as it
    ages at its own rate: a fact's tokens can keep a slow decay that a filler's do not.

    What is trained, on what: per layer and KV head, a small predictor (`kvstack train
    retention`) reads the token's key before RoPE, its value and how it stands among its head's
    tokens, and outputs log gamma and log beta; its teacher (`decay`) is the least-squares line of
    the log attention the next 128 tokens' queries give the token by age, on State of the Union
    addresses (no benchmark text).

    Deviations from the paper: its gates read the hidden state and are trained end to end with the
    model's loss under a budget, and one projection shared by all layers calibrates their
    scores so that every layer and head competes for one global budget; here each head's
    outputs are fitted (ridge, exactly) to the attention they should predict, and the budget is
    split as kvstack splits it for every scorer (`adakv(retention)` pools a layer's heads).

    Parameters: `path` a predictor file; `sinks` first tokens always kept.
    Shapes: keys, values (b, h, t, d) -> outputs (b, 2h, t) -> log utility (b, h, t).
    """

    name = "retention"
    paper = "Learned global retention-based KV eviction (#54)"

    def score(self, obs: Observation) -> torch.Tensor:
        scale, decay = self.predicted(obs, outputs=2).chunk(2, dim=1)
        age = (obs.next_position[:, None, None] - obs.positions).clamp(min=1).float()  # real tokens to the next query
        return self.keep_sinks(obs, retained(scale, decay, age))
