"""`chelsea`: Chelsea (Hu et al., 2025): Chunked Soft Matching clusters similar keys into centroids."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstack.methods.base import Method, Observation
from kvstack.methods.merge.base import Merge, Merger, pinned
from kvstack.methods.registry import register


def soft_matching(
    keys: torch.Tensor, count: torch.Tensor, free: torch.Tensor, need: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Soft Matching, repeated until each head has merged `need` (b, h) tokens away.

    One round: the free tokens still standing, in sequence order, are cut into chunks of
    `chunk_size`; inside a chunk they alternate between set A (even places) and set B (odd);
    each A token is matched to the B token of its chunk with the most similar key (cosine); the
    most similar matches of the head (at most what is still needed) merge A into B, whose key
    becomes the count-weighted centroid of its cluster for the next round. keys (b, h, t, d),
    count (b, h, t) tokens each entry stands for, free (b, h, t) tokens that may be clustered.

    Returns (root, round): (b, h, t) long, the dense position of the centroid each token ends
    in (itself for a survivor, -1 where not free), and (b, h, t) long, the round in which a
    token was merged away (0 for survivors).
    """
    b, h, t, d = keys.shape
    c, dev = max(2, min(chunk_size, t + t % 2)), keys.device  # a chunk longer than the head is the head
    n_chunks = (t + c - 1) // c
    # one extra place, t, stands for "nobody": empty chunk places point there, merges never do
    dense = torch.arange(t + 1, device=dev).expand(b, h, t + 1)
    alive = F.pad(free, (0, 1))
    parent = torch.where(alive, dense, -1)
    merged_in = torch.zeros_like(parent)
    weight = F.pad(count.float(), (0, 1), value=1.0)  # (b, h, t+1) tokens in each cluster
    centre = F.pad(keys.float() * count.float().unsqueeze(-1), (0, 0, 0, 1))  # (b, h, t+1, d) weighted sums
    need = need.clone()
    step = 0
    while bool((need > 0).any()):
        step += 1
        rank = alive.long().cumsum(-1) - 1  # place among the standing tokens, in sequence order
        place = torch.where(alive, rank, n_chunks * c)  # parked past the chunks when not standing
        at = torch.full((b, h, n_chunks * c + 1), t, device=dev, dtype=torch.long)
        at = at.scatter(-1, place, dense)[..., :-1].reshape(b, h, n_chunks, c)  # dense position of each place
        unit = F.normalize(centre / weight.unsqueeze(-1), dim=-1)
        pick = unit.gather(2, at.reshape(b, h, -1, 1).expand(-1, -1, -1, d)).reshape(b, h, n_chunks, c, d)
        a_at, b_at = at[..., 0::2], at[..., 1::2]  # (b, h, n, c/2): set A (even places), set B (odd)
        sim = pick[..., 0::2, :] @ pick[..., 1::2, :].transpose(-1, -2)  # (b, h, n, c/2, c/2)
        best, match = sim.masked_fill((b_at == t).unsqueeze(-2), float("-inf")).max(-1)
        best = best.masked_fill(a_at == t, float("-inf")).reshape(b, h, -1)  # (b, h, edges)
        into = b_at.gather(-1, match).reshape(b, h, -1)
        src = a_at.reshape(b, h, -1)
        order = best.argsort(dim=-1, descending=True, stable=True)
        first = torch.arange(order.shape[-1], device=dev).expand_as(order) < need.unsqueeze(-1)
        chosen = torch.zeros_like(first).scatter(-1, order, first) & torch.isfinite(best)
        if not bool(chosen.any()):
            break
        src = torch.where(chosen, src, t)  # unchosen edges add nothing, to nobody
        dst = torch.where(chosen, into, t)
        sums = centre.gather(2, src.unsqueeze(-1).expand(-1, -1, -1, d))
        centre = centre.scatter_add(2, dst.unsqueeze(-1).expand(-1, -1, -1, d), sums)
        weight = weight.scatter_add(-1, dst, weight.gather(-1, src))
        parent = parent.scatter(-1, src, dst)  # each chosen A is listed once; "nobody" is reset below
        merged_in = merged_in.scatter(-1, src, torch.full_like(src, step))
        alive = alive.scatter(-1, src, torch.zeros_like(chosen))
        parent[..., t], merged_in[..., t], alive[..., t] = -1, 0, False
        weight[..., t], centre[..., t, :] = 1.0, 0.0
        need = need - chosen.sum(-1)
    root = parent
    for _ in range(step):  # follow merges across rounds to the surviving centroid
        root = torch.where(root >= 0, parent.gather(-1, root.clamp(min=0)), root)
    root, merged_in = root[..., :t], merged_in[..., :t]
    return root, merged_in


@register
@dataclass
class Chelsea(Method, Merger):
    """Keys are similar along the sequence, so neighbouring tokens cluster well: Chunked Soft
    Matching (`soft_matching`) splits each chunk of `chunk_size` tokens alternately into two
    sets, matches every token of one set to its most similar key in the other, and merges the
    most similar pairs, round after round, until the head fits its budget; each cluster
    becomes one entry, the centroid (mean) of its keys and of its values. Runs at every
    compression, prefill and decoding (then the newest `decode_window` tokens stay apart).

    The tokens kept are the clusters' survivors (score 2; tokens merged away score their
    round / (rounds + 1), so a larger budget would undo the last merges first); `merge` sends
    every token left out to its cluster's survivor with weight 1.

    Deviations: from the abstract (no reference code found): the chunk size, and whether
    centroids carry their size into attention, are our choices (`log_count=True`: a cluster
    keeps the attention mass of its tokens, as ToMe's proportional attention); chunks are cut
    over the tokens still standing at each round, so a round is the paper's matching repeated
    on the merged cache.

    Shapes: keys (b, h, t, d) after RoPE -> scores, merge target and weight (b, h, t).
    """

    name = "chelsea"
    family = "merge"
    paper = "Chelsea: Efficient Long-Context LLM Inference via KV Cache Clustering (arXiv 2506.11418)"
    chunk_size: int = 32
    log_count: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 2 or self.chunk_size % 2:
            raise ValueError(f"chelsea: chunk_size must be even and >= 2 (two alternating sets), got {self.chunk_size}")

    def plan(self, obs: Observation, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(root, round) of `soft_matching` for `keep` (b, h) tokens per head, pinned tokens apart."""
        fixed = pinned(obs, self.decode_window)
        free = obs.valid & ~fixed
        room = (keep - fixed.sum(-1)).clamp(min=0)
        need = (free.sum(-1) - room).clamp(min=0)
        return soft_matching(obs.keys, obs.log_count.exp(), free, need, self.chunk_size)

    def score(self, obs: Observation) -> torch.Tensor:
        root, merged_in = self.plan(obs, obs.keep)
        rounds = merged_in.amax(-1, keepdim=True).clamp(min=1).float()  # per head: a sequence alone or in a batch
        return torch.where(
            merged_in > 0, merged_in.float() / (rounds + 1), torch.full_like(root, 2.0, dtype=torch.float)
        )

    def merge(self, obs: Observation, kept: torch.Tensor) -> Merge:
        root, _ = self.plan(obs, kept.sum(-1))
        joins = obs.valid & ~kept & (root >= 0) & torch.gather(kept, -1, root.clamp(min=0))
        return Merge(torch.where(joins, root, -1), joins.float())
