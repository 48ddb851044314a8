"""MiKV (#7, "No Token Left Behind"): tokens an eviction scorer would drop are kept at low precision.

A scorer (`mikv(snapkv)`; H2O-style accumulated attention in the paper, h2o by default) ranks the
tokens as for eviction; the ones it would keep stay at `hi` bits, the ones it would evict are
demoted to `lo` bits instead of freed, so a detail the scorer misjudged can still be attended.
Demoted tokens are never promoted back. The byte budget decides how many tokens stay at `hi`:
every token costs at least its `lo` bytes. Both precisions are per-token integer codes (the
paper's outlier balancing of the low-precision keys is not implemented). The newest `residual`
tokens stay in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.cache.encoded import Codec, Uniform
from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Observation
from kvstack.methods.evict.rescore import Rescorer
from kvstack.methods.quantize.base import Quantizer
from kvstack.methods.registry import register


@register
@dataclass
class MiKV(Rescorer, Quantizer):
    """The wrapped scorer's kept tokens at `hi` bits, the others at `lo` bits."""

    name = "mikv"
    family = "evict"
    role = "demoter"
    paper = "#7"
    scorer: object = field(default_factory=lambda: default_scorer("h2o"))
    hi: int = 8
    lo: int = 2
    group: int = 32

    def __post_init__(self) -> None:
        Rescorer.__post_init__(self)
        Quantizer.__post_init__(self)
        if self.lo >= self.hi:
            raise ValueError(f"mikv: lo={self.lo} must be below hi={self.hi} bits")

    def score(self, obs: Observation) -> torch.Tensor:
        return self.scorer.score(obs)

    def codecs(self, table: torch.Tensor | None = None) -> tuple[Codec, Codec]:
        return Uniform(self.hi, "token", self.group), Uniform(self.hi, "token", self.group)

    def demote_codecs(self) -> tuple[Codec, Codec]:
        """How the tokens the scorer leaves out are stored."""
        return Uniform(self.lo, "token", self.group), Uniform(self.lo, "token", self.group)
