"""`kvzap`: KVzip's scores predicted from each token's key and value (KVzap, arXiv 2601.07891)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Observation
from kvstack.methods.learned.scorer import LearnedScorer
from kvstack.methods.registry import register


@register
@dataclass
class KVzap(LearnedScorer):
    """A surrogate of KVzip: per layer and KV head a small predictor, trained on prose beside the
    frozen model (`kvstack train kvzap`), predicts the log of KVzip's reconstruction score of a
    token from that token alone, so scoring costs a few matrix products instead of KVzip's
    re-reading pass (5-13x a prefill), and works while decoding too: a new token is scored as it
    comes, where KVzip has no score for it. The first `sinks` tokens are kept, as KVzip's are.

    Deviations from the paper (KVzap, NVIDIA kvpress `KVzapPress`): the paper's network reads the
    layer's hidden state (D wide); here it reads the token's key before RoPE and its value (2d
    per head, a linear image of that hidden state) which the cache already holds, so nothing is
    hooked into the model, plus four numbers on how the token stands among its head's tokens
    (cosines with the mean key and value directions, norms over the mean norms), and, in the
    "local" set `kvstack train kvzap` fits by default, how it stands among the tokens just before
    it, its age and its squared coordinates (`features`; shipped files written before read "kv").
    The paper's teacher is KVzip+ (an improved KVzip); here it is KVzip's score as kvstack
    computes it (max attention of the repeat queries), on State of the Union addresses, which no
    benchmark task uses; `kvstack train kvzap --teacher future` fits it to the attention of the
    next 128 tokens instead (TokenButler's and learned retention's target; it loses the
    needles). The predictor is linear by default: a 2-layer MLP kept more of KVzip's choices on
    held-out prose but lost the repeated-sentence needle (README, learned scorers).

    Parameters: `path` a predictor file (default: the one trained here for this model, else the
    one shipped with kvstack); `sinks` first tokens always kept.
    Shapes: keys, values (b, h, t, d) -> features (b, h, t, 2d + 4) -> scores (b, h, t).
    """

    name = "kvzap"
    paper = "KVzap, a learned approximation of KVzip (arXiv 2601.07891; kvpress's KVzapPress)"

    def score(self, obs: Observation) -> torch.Tensor:
        return self.keep_sinks(obs, self.predicted(obs))
