"""`ems`: EMS (Li et al., 2024): a Global-Local score, then head-wise Evict-then-Merge."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.evict.window import window_votes
from kvstack.methods.merge.base import Merge, Merger, nearest_kept
from kvstack.methods.registry import register


def global_local(
    attention_sum: torch.Tensor, seen_by: torch.Tensor, local: torch.Tensor, local_seen_by: torch.Tensor
) -> torch.Tensor:
    """(b, h, t) the Global-Local score: the mean attention a token received from every query
    that could see it (global; the causal mask no longer favours old tokens) plus its mean
    attention from the recent window's queries (local). attention_sum (b, h, t) summed over the
    queries (and the head's group, so seen_by counts queries x group); local (b, h, t) summed over
    the window; seen_by, local_seen_by (b, h, t) how many queries of each kind saw the token."""
    glob = attention_sum.float() / seen_by.float().clamp(min=1)
    loc = local.float() / local_seen_by.float().clamp(min=1)
    return glob + loc


def evict_then_merge(
    scores: torch.Tensor,
    kept: torch.Tensor,
    valid: torch.Tensor,
    similarity: torch.Tensor,
    target: torch.Tensor,
    coverage: float,
) -> torch.Tensor:
    """(b, h, t) bool: which tokens left out are merged (the rest are evicted).

    Evict: per head, the fewest tokens that hold `coverage` of the head's score mass are its
    important ones; those left out are merge candidates, the others are evicted. A sparse head
    (mass on few tokens, all kept) evicts what it leaves out; a flat one merges it. Merge: a
    candidate joins its most similar kept key (`similarity`, `target` from `nearest_kept`) only
    if it is closer to it than to the zero class (cosine > 0), so a head with redundant keys
    merges more. scores, kept, valid, similarity, target: (b, h, t)."""
    mass = torch.where(valid, scores.float().clamp(min=0), torch.zeros_like(scores, dtype=torch.float))
    order = mass.argsort(dim=-1, descending=True, stable=True)
    ranked = mass.gather(-1, order)
    before = ranked.cumsum(-1) - ranked  # the mass of the higher-scoring tokens
    total = mass.sum(-1, keepdim=True)
    important = torch.zeros_like(valid).scatter(-1, order, before < coverage * total)  # back in dense order
    return valid & ~kept & important & (similarity > 0) & (target >= 0)


@register
@dataclass
class EMS(Method, Merger):
    """Keep the tokens with the highest Global-Local score (`global_local`): the accumulated
    attention of all queries (global, H2O-like) normalised by how many queries could see each
    token, plus the attention of the last `window_size` queries (local, SnapKV-like) normalised
    the same way, so neither the causal mask (old tokens seen more) nor the positional decay
    (recent tokens attended more) biases the choice. Of the tokens left out, each head evicts
    the least important and merges the rest into their most similar kept token
    (`evict_then_merge`): how many depends on the head's sparsity (the tokens holding `coverage`
    of its score mass are worth merging) and redundancy (the zero class: a token no kept key
    resembles is evicted).
    Merged entries carry their log-count (`log_count=True`), so repeated merges while decoding
    stay count-weighted means.

    Deviations: built from the abstract (no reference code found): the normalisation by the
    number of queries, the sum of the two scores, the coverage rule and the zero-class
    threshold 0 are our reading of "Global-Local score" and "adaptive Evict-then-Merge"; the
    paper's log-count choice is unknown (ours keeps counts). `ems(coverage=0)` evicts only.

    Shapes: attention_sum (b, h, t), queries (b, h*g, w, d), keys (b, h, t, d) -> scores,
    merge target and weight (b, h, t).
    """

    name = "ems"
    family = "merge"
    paper = "EMS: Adaptive Evict-then-Merge Strategy for Head-wise KV Cache Compression (arXiv 2412.08521)"
    needs = frozenset({"attention_sum"})
    window_size: int = 32
    coverage: float = 0.9
    log_count: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size < 1:
            raise ValueError(
                f"ems: window_size must be >= 1 (recent queries of the local score), got {self.window_size}"
            )
        if not 0.0 <= self.coverage <= 1.0:
            raise ValueError(
                f"ems: coverage must be in [0, 1] (share of the score mass worth merging), got {self.coverage}"
            )

    @property
    def roles(self) -> frozenset[str]:
        """A merger only while coverage > 0; else it evicts what it leaves out."""
        return super().roles if self.coverage > 0 else super().roles - {"merger"}

    @property
    def query_window(self) -> int:
        return self.window_size

    def score(self, obs: Observation) -> torch.Tensor:
        pos = torch.where(obs.valid, obs.positions, torch.full_like(obs.positions, -1))
        newest = pos.amax(-1, keepdim=True)  # the newest query's position
        seen_by = (newest - pos + 1).clamp(min=0) * obs.groups  # queries (x group) that attended each token
        q_slots = obs.query_slots.repeat(obs.groups)  # (g*w,) in window_votes' order
        allowed = obs.valid[:, :, None, :] & (obs.slots[:, :, None, :] <= q_slots[None, None, :, None])
        local = window_votes(obs.queries, obs, allowed)
        real = obs.query_valid.repeat(1, obs.groups)[:, None, :, None]  # (b, 1, g*w, 1)
        local_seen_by = (allowed & real).sum(2) / obs.groups
        scores = global_local(obs.attention_sum, seen_by, local, local_seen_by)
        return scores.masked_fill(~obs.valid, 0.0)

    def merge(self, obs: Observation, kept: torch.Tensor) -> Merge:
        target, similarity = nearest_kept(obs.keys, kept, obs.valid)
        joins = evict_then_merge(self.score(obs), kept, obs.valid, similarity, target, self.coverage)
        return Merge(torch.where(joins, target, -1), joins.float())
