"""`graphkv`: GraphKV (Li, Jin, Zhang, EMNLP 2025, arXiv 2509.00388): decay the scores of tokens
whose keys resemble the most important ones, so the kept set is diverse."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from kvstack.methods.allocate.base import default_scorer
from kvstack.methods.base import Method, Observation
from kvstack.methods.evict.rescore import Rescorer
from kvstack.methods.registry import register

MAX_SIMILARITY = 1.0 - 1e-6  # keeps log(1 - decay * sim) finite for exact duplicates


def pick_sources(scores: torch.Tensor, eligible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` highest `scores` (b, h, t) among `eligible` tokens of each head: their indices
    (b, h, k) and (b, h, k) False where a head has fewer than k eligible tokens."""
    masked = scores.masked_fill(~eligible, float("-inf"))
    idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    return idx, torch.gather(eligible, -1, idx)


def log_decay(unit: torch.Tensor, idx: torch.Tensor, real: torch.Tensor, decay: float) -> torch.Tensor:
    """(b, h, t) sum over the sources i of log(1 - decay * sim_ij), sim = relu(cos) of the unit
    keys (b, h, t, d); sources: indices idx (b, h, k), real (b, h, k). Cost k x t per head."""
    src = torch.gather(unit, 2, idx.unsqueeze(-1).expand(-1, -1, -1, unit.shape[-1]))  # (b, h, k, d)
    sim = torch.einsum("bhkd,bhtd->bhkt", src, unit).clamp(0.0, MAX_SIMILARITY)
    return (torch.log1p(-decay * sim) * real.unsqueeze(-1)).sum(dim=2)


@register
@dataclass
class GraphKV(Rescorer):
    """Tokens are nodes carrying the inner scorer's importance; edges are the cosine similarity of
    their keys. A decay signal spreads from the most important nodes to their neighbours, so that
    of several near-identical keys only the first is kept and the budget goes to diverse context.

    The paper's: nodes = tokens with a base method's scores (SnapKV, PyramidKV), edges = cosine
    similarity of keys, the top-K nodes propagate a decay signal to similar tokens, over one or more
    rounds. The paper gives no code; the decay rule is our reading: each non-source token j is
    multiplied by prod_i (1 - decay * sim_ij) over the round's sources i (sim = relu(cos), clamped
    below 1, summed in log space); sources keep their scores. Each further round takes the next
    `sources` best of the tokens not yet sources (re-taking the same top-K would only repeat the
    same decay). Tokens the inner scorer must keep (+inf, e.g. snapkv's window) stay +inf and are
    not sources: they are kept whatever the graph says, and the paper's SnapKV base selects among
    the tokens before the window. Scores that can be negative are first shifted so the head's
    lowest finite score is 0, so that decay always lowers a score. Cost: rounds x sources x t.

    Parameters (our defaults): `scorer` default snapkv (the paper's main base); `sources` = K, 64
    (capped at t); `rounds` 1; `decay` in [0, 1], 1.0 (0 = the inner scorer unchanged).

    Shapes: keys (b, h, t, d), inner scores (b, h, t) -> scores (b, h, t).
    """

    name = "graphkv"
    family = "evict"
    paper = "GraphKV: Breaking the Static Selection Paradigm with Graph-Based KV Cache Eviction (arXiv 2509.00388)"
    scorer: Method = field(default_factory=lambda: default_scorer("snapkv"))
    sources: int = 64
    rounds: int = 1
    decay: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sources < 1:
            raise ValueError(f"graphkv: sources must be >= 1 (tokens that spread decay per round), got {self.sources}")
        if self.rounds < 1:
            raise ValueError(f"graphkv: rounds must be >= 1, got {self.rounds}")
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"graphkv: decay must be in [0, 1] (0 = no decay), got {self.decay}")

    def score(self, obs: Observation) -> torch.Tensor:
        scores = self.scorer.score(obs).float()
        finite = obs.valid & torch.isfinite(scores)
        low = scores.masked_fill(~finite, float("inf")).amin(dim=-1, keepdim=True).clamp(max=0.0)  # (b, h, 1)
        low = torch.where(torch.isfinite(low), low, torch.zeros_like(low))
        unit = F.normalize(obs.keys.float(), dim=-1)
        k = min(self.sources, scores.shape[-1])
        done = torch.zeros_like(finite)  # tokens that were sources in an earlier round
        for _ in range(self.rounds):
            idx, real = pick_sources(scores, finite & ~done, k)
            done = done.scatter(-1, idx, torch.gather(done, -1, idx) | real)
            factor = torch.exp(log_decay(unit, idx, real, self.decay))
            scores = torch.where(finite & ~done, low + (scores - low) * factor, scores)
        return scores
