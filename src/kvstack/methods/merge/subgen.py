"""`subgen`: SubGen (Zandieh et al., 2024): online clustering of keys, l2 sampling of values."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.methods.base import Method, Observation
from kvstack.methods.merge.base import Merge, Merger, pinned
from kvstack.methods.registry import register

GRID = 2.0 ** (torch.arange(-12, 3) / 2)  # candidate radii, relative to the head's mean key norm


def online_centres(dist: torch.Tensor, free: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Online clustering by radius: tokens arrive in sequence order and one farther than `radius`
    (b, h) from every centre open so far opens a cluster (becomes a centre). dist (b, h, t, t)
    pairwise key distances; free (b, h, t) tokens to cluster (the rest are skipped). Returns
    (b, h, t) bool: the centres.

    The same decisions as a loop over the tokens, taken in rounds: a token joins once an earlier
    centre is within the radius, and opens a cluster once every earlier token within the radius
    has joined one; each round settles at least the earliest open token, most settle many.
    """
    t = dist.shape[-1]
    order = torch.arange(t, device=dist.device)
    earlier = order[:, None] > order[None, :]  # (t, t) row i, column j: j came before i
    near = (dist <= radius[..., None, None]) & earlier & free.unsqueeze(-2)  # (b, h, t, t)
    centre, undecided = torch.zeros_like(free), free.clone()

    def any_near(among: torch.Tensor) -> torch.Tensor:
        return (near & among.unsqueeze(-2)).any(-1)

    while bool(undecided.any()):
        undecided &= ~any_near(centre)  # joined a cluster
        opens = undecided & ~any_near(undecided | centre)
        centre, undecided = centre | opens, undecided & ~opens
    return centre


def fit_radius(dist: torch.Tensor, free: torch.Tensor, radius: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """(b, h, t) bool: the centres of a radius among `radius` (b, h, r, ascending, the last one
    infinite) whose clusters fit `room` (b, h) entries, found by bisection (the smallest one when
    fewer clusters come with a larger radius, as they nearly always do); dist, free as in
    `online_centres`."""
    r = radius.shape[-1]
    low = torch.full(room.shape, -1, dtype=torch.long, device=room.device)
    high = torch.full_like(low, r - 1)
    best = online_centres(dist, free, radius[..., -1])
    while bool((high - low > 1).any()):
        active = high - low > 1
        mid = torch.where(active, (low + high) // 2, high)
        centres = online_centres(dist, free, radius.gather(-1, mid.unsqueeze(-1)).squeeze(-1))
        fits = centres.sum(-1) <= room.clamp(min=1)
        best = torch.where((active & fits).unsqueeze(-1), centres, best)
        high = torch.where(active & fits, mid, high)
        low = torch.where(active & ~fits, mid, low)
    return best


def assign(dist: torch.Tensor, is_centre: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """(b, h, t) long: the centre each free token joined, the nearest of those open when it
    arrived (itself for a centre, -1 where not free); dist (b, h, t, t), is_centre, free (b, h, t)."""
    t = dist.shape[-1]
    order = torch.arange(t, device=dist.device)
    later = order[:, None] < order[None, :]  # (t, t) row i, column j: j came after i
    far = dist.float().masked_fill(~is_centre.unsqueeze(-2) | later, torch.inf)
    return torch.where(free, far.argmin(-1), -1)


def uniform(positions: torch.Tensor, head: torch.Tensor, salt: int) -> torch.Tensor:
    """Pseudo-random numbers in (0, 1), a fixed function of (position, head, salt): the same for
    a sequence alone or in a padded batch, at every compression (integer hashing, no state)."""
    x = (positions.long() * 2654435761 + head * 40503 + salt * 97) % 2**32
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) % 2**32
    x = x ^ (x >> 16)
    return (x.double() + 0.5) / 2**32


def l2_sample(centre: torch.Tensor, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(b, h, t) long: for each token's cluster (`centre`, (b, h, t), -1 for none), the member
    drawn with probability proportional to `mass` (b, h, t) (the exponential race: the least
    -log(u) / mass wins; u (b, h, t) uniform draws)."""
    t = centre.shape[-1]
    race = torch.where(centre >= 0, -torch.log(u) / mass.double().clamp(min=1e-30), torch.inf)
    best = torch.full(centre.shape, torch.inf, dtype=race.dtype, device=race.device)
    best = best.scatter_reduce(-1, centre.clamp(min=0), race, "amin")
    wins = (centre >= 0) & (race == best.gather(-1, centre.clamp(min=0)))
    dense = torch.arange(t, device=centre.device).expand_as(centre)
    winner = torch.full_like(centre, t).scatter_reduce(-1, centre.clamp(min=0), torch.where(wins, dense, t), "amin")
    return torch.where(centre >= 0, winner.gather(-1, centre.clamp(min=0)), -1)


@register
@dataclass
class SubGen(Method, Merger):
    """Keys cluster: tokens arrive in order and each joins the nearest cluster centre within a
    radius, or opens a cluster (`online_centres`); each cluster is one entry, its keys' centroid
    with its count as log-count (SubGen's estimate of the softmax normaliser, sum over clusters
    of n_c exp(q . k_c)). Values by l2 sampling (`values="l2"`): the entry is the member drawn
    with probability proportional to c_i ||v_i||^2, its value reweighted to S / (n ||v_s||^2)
    times v_s (S the cluster's sum of c_i ||v_i||^2, n its count), an unbiased estimate of the
    cluster's mean value, so n exp(q . k_c) v estimates the members' share of attention's
    numerator. `values="mean"` stores the mean value instead. The radius is the smallest of a
    grid (2^-6 .. 2 times the head's mean key norm, then infinite) whose clusters fit the budget.

    Deviations: SubGen keeps the sampled values (with their exact keys) apart from the cluster
    centres; a cache with one entry per kept token pairs each cluster with one sample drawn
    within it (stratified l2 sampling), its key replaced by the centroid. The radius follows the
    budget instead of being fixed, and the clustering is redone over the held entries at each
    compression (entries merged before join with their counts). Draws are a hash of (position,
    head, layer, `seed`): reproducible and batch-independent. One sample per cluster is unbiased
    but noisy (on the tiny test models its logits stray ~100x farther from the full cache than
    `values="mean"`'s). Cost: all pairwise key distances, O(t^2) memory per head, and a
    bisection over the radius grid (about 5 clusterings, each in a few rounds).

    Extends `Merge` with value weights and a value scale (keys and values merge differently).
    Shapes: keys, values (b, h, t, d) -> scores, merge target, weights, value scale (b, h, t).
    """

    name = "subgen"
    family = "merge"
    paper = "SubGen: Token Generation in Sublinear Time and Memory (arXiv 2402.06082)"
    values: str = "l2"
    seed: int = 0
    log_count: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.values not in ("l2", "mean"):
            raise ValueError(f"subgen: values must be 'l2' (sampled) or 'mean', got {self.values!r}")

    def plan(self, obs: Observation, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(centre, entry, count), each (b, h, t): each free token's cluster centre and the member
        that stands for its cluster (-1 for pinned tokens and padding), and the tokens each held
        entry stands for; `keep` (b, h) entries per head, pinned ones apart."""
        fixed = pinned(obs, self.decode_window)
        free = obs.valid & ~fixed
        keys = obs.keys.float()
        norm = torch.where(free, keys.norm(dim=-1), 0.0).sum(-1) / free.sum(-1).clamp(min=1)  # (b, h)
        radius = torch.cat([norm[..., None] * GRID.to(norm.device), torch.full_like(norm[..., None], torch.inf)], -1)
        dist = torch.cdist(keys, keys, compute_mode="donot_use_mm_for_euclid_dist")  # (b, h, t, t), exact
        centres = fit_radius(dist, free, radius, keep - fixed.sum(-1))
        centre = assign(dist, centres, free)
        count = obs.log_count.exp()
        if self.values == "mean":
            return centre, centre, count
        heads = torch.arange(centre.shape[1], device=centre.device)[None, :, None]
        u = uniform(obs.positions, heads, self.seed * 1000 + obs.layer_idx)
        mass = count * obs.values.float().pow(2).sum(-1) + 1e-12 * count  # all-zero values: uniform draw
        return centre, l2_sample(centre, mass, u), count

    def score(self, obs: Observation) -> torch.Tensor:
        centre, entry, _ = self.plan(obs, obs.keep)
        dense = torch.arange(centre.shape[-1], device=centre.device)
        dist = (
            obs.keys.float() - torch.gather(obs.keys.float(), 2, centre.clamp(min=0)[..., None].expand_as(obs.keys))
        ).norm(dim=-1)
        # entries first; then members far from their centre (worst represented), if the budget has room
        return torch.where(entry == dense, 2.0, dist / (1 + dist))

    def merge(self, obs: Observation, kept: torch.Tensor) -> Merge:
        _, entry, count = self.plan(obs, kept.sum(-1))
        joins = obs.valid & ~kept & (entry >= 0) & torch.gather(kept, -1, entry.clamp(min=0))
        target = torch.where(joins, entry, -1)
        if self.values == "mean":
            return Merge(target, joins.float())
        energy = count * obs.values.float().pow(2).sum(-1)  # c_i ||v_i||^2
        into = target.clamp(min=0)
        total = energy.scatter_add(-1, into, torch.where(joins, energy, 0.0))  # S over each entry and its joiners
        n = count.scatter_add(-1, into, torch.where(joins, count, 0.0))
        scale = torch.where(energy > 0, total * count / (n * energy.clamp(min=1e-30)), 1.0)
        joined = kept & obs.valid & (n > count)  # entries that take someone in; the rest keep their value
        return Merge(target, joins.float(), torch.zeros_like(count), torch.where(joined, scale, 1.0))
