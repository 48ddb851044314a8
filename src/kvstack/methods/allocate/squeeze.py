"""`squeeze`: SqueezeAttention (Wang et al., 2024): layers whose attention barely changes the hidden state keep less."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.cache.hidden import SIGNAL
from kvstack.methods.allocate.base import Allocator, Plan
from kvstack.methods.registry import register

KMEANS_STEPS = 100


def kmeans_1d(values: torch.Tensor, k: int = 3, steps: int = KMEANS_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (n,), centers (k,)) of Lloyd's k-means on the scalars `values` (n,).

    Deterministic: the centers start at the minimum, the median (the lower one for an even n)
    and the maximum (for k = 3; evenly spaced quantiles otherwise); ties go to the lower
    cluster, and an empty cluster keeps its center. In 1-D the clusters stay ordered intervals.
    """
    x = values.double()
    centers = torch.quantile(x, torch.linspace(0, 1, k, dtype=x.dtype), interpolation="lower")
    labels = torch.zeros_like(x, dtype=torch.long)
    for _ in range(steps):
        labels = (x[:, None] - centers[None, :]).abs().argmin(-1)
        members = torch.nn.functional.one_hot(labels, k).to(x.dtype)  # (n, k)
        size = members.sum(0)
        moved = torch.where(size > 0, (members * x[:, None]).sum(0) / size.clamp(min=1), centers)
        if torch.equal(moved, centers):
            break
        centers = moved
    return labels, centers


def squeeze_weights(cos: Sequence[float] | torch.Tensor, p: float) -> torch.Tensor:
    """(L,) budget weights from each layer's mean cosine (L,) between its input and post-attention
    residual stream: the k-means cluster (k=3) with the highest cosine, the least important,
    keeps `p` x its uniform share; the other layers share the rest equally, so the weights still
    add up to L. Uniform when all cosines are equal or every layer falls in that cluster.
    """
    x = torch.as_tensor(cos, dtype=torch.float64)
    L = x.numel()
    if L < 2 or bool(x.max() - x.min() <= 0):
        return torch.ones(L, dtype=torch.float64)
    labels, centers = kmeans_1d(x)
    least = labels == int(centers.argmax())
    n_least = int(least.sum())
    if n_least == L:
        return torch.ones(L, dtype=torch.float64)
    rest = (L - n_least * p) / (L - n_least)
    return torch.where(least, torch.full_like(x, p), torch.full_like(x, rest))


@register
@dataclass
class Squeeze(Allocator):
    """A layer's importance is how much self-attention turns its tokens: the cosine similarity
    between the residual stream entering the layer and after the attention output was added,
    per token over the hidden dimension, averaged over the prompt (measured by
    `kvstack.cache.hidden` during prefill, one scalar per layer and sequence). The layers are
    clustered by k-means (k=3); the cluster with the highest cosine (the least important) keeps
    `p` x the uniform budget and the other layers share what it frees equally
    (utils_hh/modify_llama_drop.py in hetailang/SqueezeAttention; it calls sklearn's KMeans with
    random k-means++ starts, ours is a deterministic 1-D Lloyd from min/median/max).

    p: 0.3 (the reference code's `percent`, a per-run setting there). Deviation: the reference sets
    absolute prompt fractions (`percent * prompt_len` for that cluster, the remainder of
    `L * ini_size` for the others); we use p relative to the uniform share so the allocator
    stays budget-agnostic. The scorer (default snapkv, like the other allocators here) picks
    tokens inside each layer's budget; the paper pairs SqueezeAttention with sliding window,
    StreamingLLM (that reference file) and H2O: `squeeze(streaming)`, `squeeze(h2o)`. A cache
    built from a bare config measures nothing and falls back to uniform weights.

    Shapes: signals["hidden_cosine"][l] (b,) -> weights (L, b, h).
    """

    name = "squeeze"
    paper = (
        "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via Layer-wise Optimal Budget (arXiv 2404.04793)"
    )
    needs = frozenset({SIGNAL})
    whole_prompt: ClassVar[bool] = True
    p: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"squeeze: p must be in (0, 1] (least important layers' share of uniform), got {self.p}")

    def weights(self, plan: Plan) -> torch.Tensor | None:
        L, b, h = plan.shape
        measured = plan.signals.get(SIGNAL, {})
        if any(layer_idx not in measured for layer_idx in range(L)):
            return None
        cos = torch.stack([measured[layer_idx].double().cpu() for layer_idx in range(L)])  # (L, b)
        w = torch.stack([squeeze_weights(cos[:, row], self.p) for row in range(b)], dim=1)  # (L, b)
        return w[:, :, None].expand(L, b, h).to(plan.base.device)
