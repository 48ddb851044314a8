"""`lycheedecode`: LycheeDecode (#64), a few retrieval heads choose, the sparse heads follow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstack.errors import UserError
from kvstack.methods.evict.quest_pages import criticality
from kvstack.methods.registry import register
from kvstack.methods.retrieve.base import Retriever
from kvstack.methods.retrieve.s3 import reciprocal_rank


@register
@dataclass
class LycheeDecode(Retriever):
    """LycheeDecode splits the attention heads into a small set of retrieval heads, which find
    the tokens that matter at each decoding step, and a majority of sparse heads, which reuse
    what the retrieval heads found: one selection shared at the grain of heads rather than of
    whole layers, so heads keep their different roles. Here, in each layer, the `leaders` KV
    heads with the highest retrieval score rank the tier's pages by Quest's bound (the channel-
    wise key minimum and maximum of each page, resident); every other head brings back the pages
    the leaders rank best (one leader: its ranking; several: fused by reciprocal rank).

    Deviations: LycheeDecode learns which heads retrieve with HardKuma gates trained on the
    model; without training, the heads are ranked by HeadKV's retrieval score (the attention a
    head's top positions put on a needle it copies, `kvstack.calibrate.heads.headkv_scores`,
    measured once per model and shared with `headkv`). Its retrieval heads attend the whole
    context to pick exact top-k tokens; here they rank pages by a bound, since reading every
    page at each step would undo the slow tier. Page numbers name the same tokens in every head
    when the resident scorer treats heads alike (`streaming`, the default); with a per-head
    scorer a follower brings back its own pages of the same numbers.

    Shapes: queries (b, h, g*q, d), index (b, h, P, d) -> (b, h, P); table (L, h) scores.
    """

    name = "lycheedecode"
    paper = "LycheeDecode: fine-grained hybrid-head attention for long-context decoding (#64)"
    leaders: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.leaders < 1:
            raise ValueError(f"{self.name}: leaders must be >= 1 retrieval head per layer, got {self.leaders}")

    def load(self, model: Any) -> torch.Tensor:
        """(L, h) retrieval score of each KV head, measured once per model."""
        from kvstack.calibrate import calibrated
        from kvstack.calibrate.heads import headkv_scores

        if not hasattr(model, "config") or not hasattr(model, "named_parameters"):
            raise UserError(
                "lycheedecode ranks the model's heads by their retrieval score: build the KVCache from the model"
            )
        return calibrated(model, "headkv-v1", headkv_scores)

    def rank(
        self, queries: torch.Tensor, index: dict[str, torch.Tensor], text: torch.Tensor | None = None
    ) -> torch.Tensor:
        return criticality(queries.float(), index["lo"].float(), index["hi"].float()).amax(dim=2)

    def lead(self, ranks: torch.Tensor, table: Any, layer: int) -> torch.Tensor:
        heads = ranks.shape[1]
        if table is None or self.leaders >= heads:
            return ranks
        leaders = retrieval_heads(table[layer], self.leaders).to(ranks.device)
        led = ranks[:, leaders]  # (b, leaders, P)
        followed = led if len(leaders) == 1 else reciprocal_rank(led).sum(1, keepdim=True)
        out = followed.expand_as(ranks).clone()
        out[:, leaders] = ranks[:, leaders]
        return out


def retrieval_heads(scores: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) the KV heads of one layer with the highest retrieval scores (h,), ties to the lower head."""
    return torch.sort(scores.float(), descending=True, stable=True).indices[:n].sort().values
