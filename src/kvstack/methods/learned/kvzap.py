"""`kvzap`: KVzip's scores predicted from each token's key and value (KVzap, arXiv 2601.07891)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstack.errors import UserError
from kvstack.methods.base import Method, Observation
from kvstack.methods.learned.predictor import Predictor, features, find, load
from kvstack.methods.registry import register
from kvstack.models.rope import rotate

_MEMO: dict[tuple[str, float], Predictor] = {}


@register
@dataclass
class KVzap(Method):
    """A surrogate of KVzip: per layer and KV head a small predictor, trained on prose beside the
    frozen model (`kvstack train kvzap`), predicts the log of KVzip's reconstruction score of a
    token from that token alone, so scoring costs a few matrix products instead of KVzip's
    re-reading pass (5-13x a prefill), and works while decoding too: a new token is scored as it
    comes, where KVzip has no score for it. The first `sinks` tokens are kept, as KVzip's are.

    Deviations from the paper (KVzap, NVIDIA kvpress `KVzapPress`): the paper's network reads the
    layer's hidden state (D wide); here it reads the token's key before RoPE and its value (2d
    per head, a linear image of that hidden state) which the cache already holds, so nothing is
    hooked into the model, plus four numbers on how the token stands among its head's tokens
    (cosines with the mean key and value directions, norms over the mean norms: `features`).
    The paper's teacher is KVzip+ (an improved KVzip); here it is KVzip's score as kvstack
    computes it (max attention of the repeat queries), on State of the Union addresses, which no
    benchmark task uses. The predictor is linear by default: a 2-layer MLP kept more of KVzip's
    choices on held-out prose but lost the repeated-sentence needle (README, learned scorers).

    Parameters: `path` a predictor file (default: the one trained here for this model, else the
    one shipped with kvstack); `sinks` first tokens always kept.
    Shapes: keys, values (b, h, t, d) -> features (b, h, t, 2d + 4) -> scores (b, h, t).
    """

    name = "kvzap"
    family = "evict"
    paper = "KVzap, a learned approximation of KVzip (arXiv 2601.07891; kvpress's KVzapPress)"
    path: str = ""
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"kvzap: sinks must be >= 0 (first tokens always kept), got {self.sinks}")

    @property
    def min_tokens(self) -> int:
        return max(1, self.sinks)

    def load(self, model: Any) -> Predictor:
        """The predictor trained for this model (memoised per file)."""
        from kvstack.calibrate.store import model_key

        if not hasattr(model, "config") or not hasattr(model, "named_parameters"):
            raise UserError("kvzap scores with a predictor trained for the model: build the KVCache from the model")
        key, name = model_key(model), getattr(model, "kvstack_name", "MODEL")
        path = Path(self.path) if self.path else find(key, self.name, name)
        stamp = (str(path), path.stat().st_mtime if path.exists() else 0.0)
        if stamp not in _MEMO:
            _MEMO[stamp] = load(path, key, self.name, name)
        return _MEMO[stamp]

    def score(self, obs: Observation) -> torch.Tensor:
        predictor = obs.tables.get(self.name)
        if not isinstance(predictor, Predictor):
            raise UserError("kvzap has no predictor: build the KVCache from the model (KVCache(model, ...))")
        keys = obs.keys
        if obs.inv_freq is not None:
            keys = rotate(keys.float(), -obs.positions.float(), obs.inv_freq)  # back to before RoPE
        scores = predictor.predict(obs.layer_idx, features(keys, obs.values, obs.valid))
        sink = obs.valid & (obs.positions < self.sinks)
        return torch.where(sink, torch.full_like(scores, float("inf")), scores)
