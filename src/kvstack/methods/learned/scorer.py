"""What every learned scorer shares: its predictor found and loaded once per model, its
features read from the cache (keys rotated back to before RoPE), the first tokens kept."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstack.errors import UserError
from kvstack.methods.base import Method, Observation
from kvstack.methods.learned.files import find
from kvstack.methods.learned.predictor import Predictor, load
from kvstack.methods.learned.sink_attention import SinkAttention

_MEMO: dict[tuple[str, float], Predictor | SinkAttention] = {}


@dataclass
class LearnedScorer(Method):
    """Base of the scorers whose scores a small predictor per head gives (`kvstack train NAME`).

    Parameters: `path` a predictor file (default: the one trained here for this model, else the
    one shipped with kvstack); `sinks` first tokens always kept.
    """

    family = "evict"
    path: str = ""
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"{self.name}: sinks must be >= 0 (first tokens always kept), got {self.sinks}")

    @property
    def min_tokens(self) -> int:
        return max(1, self.sinks)

    def load(self, model: Any) -> Predictor | SinkAttention:
        """The predictor trained for this model (memoised per file)."""
        from kvstack.calibrate.store import model_key

        if not hasattr(model, "config") or not hasattr(model, "named_parameters"):
            fix = "build the KVCache from the model"
            raise UserError(f"{self.name} scores with a predictor trained for the model: {fix}")
        key, name = model_key(model), getattr(model, "kvstack_name", "MODEL")
        path = Path(self.path) if self.path else find(key, self.name, name)
        stamp = (str(path), path.stat().st_mtime if path.exists() else 0.0)
        if stamp not in _MEMO:
            _MEMO[stamp] = load(path, key, self.name, name)
        return _MEMO[stamp]

    def predicted(self, obs: Observation, outputs: int = 1) -> torch.Tensor:
        """(b, outputs*h, t) the predictor's outputs for every held token: `outputs` blocks of h."""
        predictor = obs.tables.get(self.name)
        if not isinstance(predictor, (Predictor, SinkAttention)):
            raise UserError(f"{self.name} has no predictor: build the KVCache from the model (KVCache(model, ...))")
        if predictor.heads != outputs * obs.keys.shape[1]:
            raise UserError(
                f"{self.name}'s predictor has {predictor.heads} outputs per layer, not {outputs} per KV head "
                f"({obs.keys.shape[1]}): rebuild it with `kvstack train {self.name}`"
            )
        ages = obs.next_position[:, None, None] - obs.positions  # (b, h, t) tokens up to the next query
        return predictor.score(obs.layer_idx, obs.keys, obs.values, obs.valid, ages, obs.positions, obs.inv_freq)

    def keep_sinks(self, obs: Observation, scores: torch.Tensor) -> torch.Tensor:
        """`scores` (b, h, t) with the first `sinks` tokens scored +inf (always kept)."""
        sink = obs.valid & (obs.positions < self.sinks)
        return torch.where(sink, torch.full_like(scores, float("inf")), scores)
