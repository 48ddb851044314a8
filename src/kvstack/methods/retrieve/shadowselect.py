"""`shadowselect`: ShadowKV's sparse selection (#17): chunk landmarks rank, outlier chunks stay."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.methods.base import Observation
from kvstack.methods.registry import register
from kvstack.methods.retrieve.base import Retriever


@register
@dataclass
class ShadowSelect(Retriever):
    """ShadowKV decodes over a sparse set of chunks rebuilt on the fly. Each chunk of 8 tokens
    has a landmark, the mean of its post-RoPE keys, kept resident; at each step the query's
    attention over the landmarks (a softmax over chunks, summed over the query heads of a KV
    head) picks the chunks to bring back. Chunks whose keys the landmark represents badly (the
    lowest cosine similarity of a key to its chunk's mean) are outliers, kept resident and
    exact. Here: the tier's pages are the chunks and their means the landmarks; the resident
    set is the `scorer`'s (sinks and recent tokens) plus the `outliers` chunks of 8 tokens per
    head that deviate most, chosen among the chunks held whole when the layer compresses.

    Deviations: ShadowKV keeps every key resident as rank-r factors of its pre-RoPE form and
    rebuilds the chosen chunks' keys from them (`shadowkv` is that codec); at 1/16 of the bytes
    those factors (20 of 128 dimensions per head in the paper) do not fit, so the tier holds the
    keys with the values and both come back. Chunks of 8 make the landmarks 1/16 of the cache, a
    whole 1/16 budget: pages are `page` tokens (32 by default) and outliers are chunks of 8.
    Outliers are re-chosen at each compression among the chunks held whole, not fixed at prefill,
    and take at most half of what a head keeps resident.

    Shapes: queries (b, h, g*q, d), means (b, h, P, d) -> (b, h, P); keys (b, h, t, d) -> (b, h, t).
    """

    name = "shadowselect"
    paper = "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference (arXiv 2410.21465)"
    summaries: ClassVar[tuple[str, ...]] = ("mean",)
    chunk: ClassVar[int] = 8  # tokens of an outlier chunk (ShadowKV's chunk)
    page: int = 32
    outliers: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.outliers < 0:
            raise ValueError(f"{self.name}: outliers must be >= 0 chunks of 8 tokens per head, got {self.outliers}")

    def score(self, obs: Observation) -> torch.Tensor:
        """The scorer's scores, with the outlier chunks' tokens kept first (+inf): at most half
        of what a head keeps, so the scorer's recent tokens stay."""
        scores = self.scorer.score(obs)
        n = torch.clamp(obs.keep // (2 * self.chunk), max=self.outliers)  # (b, h)
        if not bool((n > 0).any()):
            return scores
        kept = outlier_chunks(obs.keys, obs.positions, obs.valid, self.chunk, n)
        return torch.where(kept, torch.full_like(scores, float("inf")), scores)

    def rank(
        self, queries: torch.Tensor, index: dict[str, torch.Tensor], text: torch.Tensor | None = None
    ) -> torch.Tensor:
        means = index["mean"].float()
        logits = queries.float() @ means.transpose(-1, -2) / math.sqrt(queries.shape[-1])  # (b, h, m, P)
        empty = (means == 0).all(-1)  # (b, h, P) pages not yet written (a page's mean is never exactly 0)
        logits = logits.masked_fill(empty[:, :, None, :], float("-inf"))
        return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=2)


def outlier_chunks(
    keys: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, chunk: int, n: torch.Tensor
) -> torch.Tensor:
    """(b, h, t) True for the tokens of the n (b, h) chunks (positions // chunk) per head, among those
    held whole, whose keys (b, h, t, d) are worst represented by their mean: the lowest cosine
    similarity of a key to its chunk's mean key (ShadowKV's outliers)."""
    b, h, t, d = keys.shape
    ids = torch.where(valid, positions // chunk, 0).long()  # (b, h, t)
    n_chunks = int(ids.max()) + 1 if ids.numel() else 1
    x = keys.float() * valid[..., None]
    sums = x.new_zeros(b, h, n_chunks, d).scatter_add_(2, ids[..., None].expand(b, h, t, d), x)
    counts = x.new_zeros(b, h, n_chunks).scatter_add_(2, ids, valid.float())
    mean = sums / counts.clamp(min=1)[..., None]
    cos = torch.nn.functional.cosine_similarity(x, mean.gather(2, ids[..., None].expand(b, h, t, d)), dim=-1)
    cos = cos.masked_fill(~valid, float("inf"))
    worst = x.new_full((b, h, n_chunks), float("inf")).scatter_reduce_(2, ids, cos, "amin")
    deviation = torch.where(counts == chunk, 1 - worst, float("-inf"))  # only chunks held whole
    most = int(n.max())
    top = torch.sort(deviation, dim=-1, descending=True, stable=True).indices[..., :most]  # (b, h, most)
    real = (deviation.gather(-1, top) > float("-inf")) & (torch.arange(top.shape[-1], device=top.device) < n[..., None])
    chosen = torch.zeros(b, h, n_chunks, dtype=torch.bool, device=keys.device).scatter_(-1, top, real)
    return chosen.gather(-1, ids) & valid
