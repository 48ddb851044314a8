"""Budget allocators: how many tokens each layer and head keeps, around any scorer.

An allocator wraps a scorer (`pyramid(snapkv)`, `adakv(keydiff)`) and decides budgets, never
tokens. Its decision is plain data: `weights` (L, b, h), each layer's and head's share of the
budget relative to a uniform split, turned into token counts by `distribute` (a pure function
that holds the total); and `split`, a re-division of one layer's total among its heads from
the scorer's scores. The cache executes both and the scorer picks the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch

from kvstack.methods.base import Method, Observation, Stage


def default_scorer(name: str = "snapkv") -> Method:
    """A fresh instance of a registered scorer, for an allocator's default `scorer` field."""
    from kvstack.methods.registry import method_class

    return method_class(name)()  # type: ignore[return-value]


class Plan:
    """What a whole-prompt allocator sees after the prompt went through every layer.

    base: (L, b) tokens each head of each layer would keep under a uniform split; room: (L, b)
    tokens it holds that may be evicted; `observation(l)` and `scores(l)` (b, h, t) are built on
    first access; `signals` holds per-layer measurements recorded during the forward pass.
    """

    def __init__(self, policy: Any, base: torch.Tensor, room: torch.Tensor) -> None:
        self._policy = policy  # the cache's `kvstack.policy.Policy`
        self.base, self.room = base, room
        self.layers = policy.cache.layers
        self.n_layers = len(self.layers)
        self.n_heads = self.layers[0].n_kv_heads
        self.signals = policy.cache.signals
        self.calibration = policy.calibration  # kind -> table measured on the model (head allocators)
        self._scores: dict[int, torch.Tensor] = {}
        # layer -> (scorer, seen, scores) of the layers whose scorer read no split (`Observation.read_keep`)
        self.unsplit: dict[int, tuple[Any, int, torch.Tensor]] = {}

    def observation(self, layer_idx: int) -> Observation:
        layer = self.layers[layer_idx]
        keep = self.base[layer_idx].unsqueeze(1).expand(-1, layer.n_kv_heads)
        return Observation(layer, keep, self._policy.cache.seq.token_index(), tables=self._policy.tables)

    def scores(self, layer_idx: int) -> torch.Tensor:
        """(b, h, t) the stack's scorer on layer `layer_idx`, exempt tokens at +inf."""
        if layer_idx not in self._scores:
            obs, scorer = self.observation(layer_idx), self._policy.scorer(layer_idx)
            self._scores[layer_idx] = self._policy.scores(obs)
            if not obs.read_keep:  # the uniform split was not read: the layer's compression may reuse them
                self.unsplit[layer_idx] = (scorer, obs.seen, self._scores[layer_idx])
        return self._scores[layer_idx]

    @cached_property
    def shape(self) -> tuple[int, int, int]:
        """(L, b, h)."""
        return self.n_layers, self.base.shape[1], self.n_heads


@dataclass
class Allocator(Stage):
    """Base of the budget allocators: `scorer` picks tokens inside the budgets this decides.

    `whole_prompt`: the weights need every layer's view of the prompt, so the cache compresses
    once the prompt has gone through the last layer (peak memory is then the full prompt's).
    `splits`: `split` moves budget between a layer's heads, so the cache holds the layer's total
    (a head may hold more than a uniform share).
    """

    family: ClassVar[str] = "allocate"
    role: ClassVar[str] = "allocator"
    whole_prompt: ClassVar[bool] = False
    splits: ClassVar[bool] = False  # True when `split` moves budget between a layer's heads
    scorer: Stage = field(default_factory=default_scorer)

    def __post_init__(self) -> None:
        if not isinstance(self.scorer, Stage) or self.scorer.family not in ("evict", "allocate", "merge"):
            given = getattr(self.scorer, "name", self.scorer)
            raise ValueError(f"{self.name}: scorer must be an eviction method such as snapkv, got {given!r}")

    @property
    def query_window(self) -> int:
        return self.scorer.query_window  # type: ignore[attr-defined]

    @property
    def min_tokens(self) -> int:
        return self.scorer.min_tokens  # type: ignore[attr-defined]

    @property
    def compresses(self) -> bool:
        return True

    @property
    def kind(self) -> str:
        """Name under which the cache keeps what `prepare` returns."""
        return self.name

    def prepare(self, model: Any) -> torch.Tensor | None:
        """Anything measured on the model once, before any prompt (a head calibration); None = nothing."""
        return None

    def weights(self, plan: Plan) -> torch.Tensor | None:
        """(L, b, h) budget weights relative to a uniform split (1 = uniform), or None."""
        return None

    def split(self, scores: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """(b, h) tokens per head from one layer's keep (b, h) and scores (b, h, t); default: as given."""
        return keep


def distribute(
    weights: torch.Tensor, base: torch.Tensor, room: torch.Tensor, least: torch.Tensor | int = 0
) -> torch.Tensor:
    """(L, b, h) token counts: the total of `base` per sequence, shared in proportion to weights x base.

    weights, base, room: (L, b, h). Every head first gets `least` tokens (what its scorer needs,
    capped by its room); no head gets more than its `room` (what it holds), and what a capped
    head cannot use is shared again among the others (water-filling). The total kept equals the
    uniform total whenever the heads can hold it, and never exceeds it.
    """
    room = room.double()
    floor = torch.minimum(torch.as_tensor(least, dtype=torch.float64, device=room.device).expand_as(room), room)
    room = room - floor
    want = weights.double().clamp(min=0) * base.double()
    total = (base.double().sum(dim=(0, 2)) - floor.sum(dim=(0, 2))).clamp(min=0)  # (b,)
    capped = torch.zeros_like(want, dtype=torch.bool)
    alloc = torch.zeros_like(want)
    for _ in range(want.shape[0] * want.shape[2] + 1):
        left = total - torch.where(capped, room, torch.zeros_like(room)).sum(dim=(0, 2))
        free_want = torch.where(capped, torch.zeros_like(want), want)
        wanted = free_want.sum(dim=(0, 2))
        scale = torch.where(wanted > 0, left / torch.where(wanted > 0, wanted, torch.ones_like(wanted)), wanted)
        alloc = torch.where(capped, room, free_want * scale[None, :, None])
        newly = ~capped & (alloc > room)
        if not bool(newly.any()):
            break
        capped |= newly
    return (floor + torch.minimum(torch.floor(alloc + 1e-9), room)).long()
