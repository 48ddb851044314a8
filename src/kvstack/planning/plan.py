"""A plan: per layer a scorer, per layer and head a storage and a byte share, as plain data.

`decide` turns distortion curves and a budget into a decision at a reference length; `Plan.at`
and `Plan.shares_now` execute it at the length at hand, rescaling the shares so the total stays
within the budget as the sequence grows; a plan saves to and loads from JSON (`kvstack plan
--save`, `--method plan:FILE`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvstack.cache.budget import Cost, size_text, tokens_at_fraction
from kvstack.errors import UserError
from kvstack.planning.options import Storage, cost, held_bytes
from kvstack.planning.solve import SHARE_RANGE, solve


@dataclass
class Plan:
    """What `auto` decided for one model and budget (lists: per layer, per head), and what it
    keeps at `length` tokens.

    scorers, storages, shares: the decision, solved once at a reference length; `at` executes
    it at any length (shares rescaled to the budget there), so a sequence's cache never depends
    on the other rows of its batch. tokens, bytes: what each head keeps and holds right after
    compression at `length` (slots included); held: tokens a full cache holds per head of each
    layer there (a sliding layer: its window); token_bytes: a plain token's key and value in one
    head, slot: its position index once compressed; all per sequence. Every head keeps at least
    `least` tokens and `uniform` of a uniform split of the budget.
    """

    model: str
    budget: str
    length: int
    scorers: list[str]
    storages: list[list[str]]
    shares: list[list[float]]
    tokens: list[list[int]]
    bytes: list[list[float]]
    held: list[int]
    token_bytes: int
    slot: int
    head_dim: int
    least: int
    uniform: float = 0.0
    chosen: str = ""  # which candidate decision this is, and why (kvstack.planning.validate)

    @property
    def full_bytes(self) -> int:
        """Bytes a full cache holds for the same tokens."""
        return sum(self.held) * len(self.storages[0]) * self.token_bytes

    def layer_full_bytes(self, layer: int) -> int:
        return self.held[layer] * len(self.storages[layer]) * self.token_bytes

    @property
    def total_bytes(self) -> float:
        return float(sum(sum(row) for row in self.bytes))

    def costs(self) -> Cost:
        """What a token costs each head under its storage: a `Cost.table` with fields (L, h)."""
        return Cost.table(
            [
                [cost(Storage.from_text(t), self.head_dim, self.token_bytes, self.slot) for t in row]
                for row in self.storages
            ]
        )

    def storage(self, layer: int, head: int) -> Storage:
        return Storage.from_text(self.storages[layer][head])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """A saved plan, or a one-line error naming the fix."""
        file = Path(path)
        shown = str(path) if len(str(path)) <= 80 else f"{str(path)[:77]}..."
        try:
            text = file.read_text()
        except FileNotFoundError:
            raise UserError(
                f"plan file {shown} does not exist: write one with `kvstack plan --model M --save {shown}`"
            ) from None
        except IsADirectoryError:
            raise UserError(f"plan {shown} is a directory: give a plan file written by `kvstack plan --save`") from None
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(
                f"cannot read plan file {shown} ({type(err).__name__}): give one written by `kvstack plan --save`"
            ) from None
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as err:
            raise UserError(f"{path} is not a kvstack plan ({err}): write one with `kvstack plan --save`") from None

    def shares_now(self, n: torch.Tensor, budget_bytes: float) -> torch.Tensor:
        """(L, h) byte shares for heads holding n (L,) tokens now: the decided shares scaled by one
        factor so their bytes sum to `budget_bytes`, each between its floor (`least` plain tokens,
        `uniform` of a uniform split) and 1 (its full bytes)."""
        floor = floor_shares(
            n, self.least, self.token_bytes, self.slot, self.uniform, budget_bytes, len(self.shares[0])
        )
        return rescale(torch.tensor(self.shares, dtype=torch.float64), n, budget_bytes, self.token_bytes, floor)

    def at(self, n: torch.Tensor, budget_bytes: float) -> Plan:
        """This decision executed for heads holding n (L,) tokens under `budget_bytes`: the tokens
        each head keeps (as the cache counts them) and the bytes it then holds; everything, in
        the model's dtype, when the budget pays for the full cache."""
        heads = len(self.storages[0])
        if budget_bytes >= float(n.sum()) * heads * self.token_bytes:
            tokens = [[int(x)] * heads for x in n]
            held = [[float(x) * self.token_bytes] * heads for x in n]
            plain = [["16"] * heads for _ in n]
            return replace(self, length=int(n.max()), storages=plain, tokens=tokens, bytes=held, held=n.tolist())
        shares = self.shares_now(n, budget_bytes)
        kept_all = tokens_kept(shares[None], n[None], self.costs(), self.least)[0].tolist()  # as the cache keeps
        tokens, held = [], []
        for i, (row, kept) in enumerate(zip(self.storages, kept_all, strict=True)):
            storages = [Storage.from_text(text) for text in row]
            slot = self.slot if any(k < int(n[i]) for k in kept) else 0  # a layer keeping everything has no slots
            tokens.append(kept)
            held.append(
                [held_bytes(k, st, self.head_dim, self.token_bytes, slot) for k, st in zip(kept, storages, strict=True)]
            )
        return replace(self, length=int(n.max()), tokens=tokens, bytes=held, held=n.tolist())


def decide(
    distortion: torch.Tensor,
    fractions: torch.Tensor,
    scorers: list[str],
    storages: list[Storage],
    n: torch.Tensor,
    head_dim: int,
    full: int,
    slot: int,
    budget_bytes: float,
    least: int,
    model: str = "",
    budget: str = "",
    check: bool = True,
    uniform: float = 0.0,
) -> Plan:
    """The decision for heads holding n (L,) tokens each under `budget_bytes` per sequence (see
    `solve`), executed at n; with `check`, a one-line error when even `least` tokens per head at
    full precision do not fit (else every head takes its cheapest option)."""
    if check:
        check_fits(n, distortion.shape[2], full + slot, least, budget_bytes, budget)
    costs = [cost(s, head_dim, full, slot) for s in storages]
    floor = floor_shares(n, least, full, slot, uniform, budget_bytes, distortion.shape[2])
    choice = solve(distortion, fractions, n, costs, budget_bytes, least, floor)
    decided = Plan(
        model=model,
        budget=budget,
        length=int(n.max()),
        scorers=[scorers[int(s)] for s in choice.scorer],
        storages=[[str(storages[int(q)]) for q in row] for row in choice.storage],
        shares=choice.share.double().tolist(),
        tokens=[],
        bytes=[],
        held=n.tolist(),
        token_bytes=full,
        slot=slot,
        head_dim=head_dim,
        least=least,
        uniform=uniform,
    )
    return decided.at(n, budget_bytes)


def check_fits(n: torch.Tensor, heads: int, plain: int, least: int, budget_bytes: float, budget: str = "") -> None:
    """One-line error when `least` tokens per head at `plain` bytes each (n (L,) tokens held per
    head) cost more than `budget_bytes`: the smallest cache auto can hold."""
    smallest = float(torch.clamp(n, max=least).sum()) * heads * plain
    if budget_bytes < smallest:
        raise UserError(
            f"budget {budget or size_text(budget_bytes)} is below the smallest cache auto can hold for "
            f"{int(n.max())} tokens ({least} tokens per head at full precision, {size_text(smallest)}): "
            f"use a budget of at least {size_text(smallest)}"
        )


def rescale(shares: torch.Tensor, n: torch.Tensor, budget_bytes: float, full: int, floor: torch.Tensor) -> torch.Tensor:
    """(L, h) shares (L, h) scaled by one factor, each clamped to [floor (L,), 1], so their bytes
    (share x n (L,) x full) sum to `budget_bytes` where the clamps allow (bisection on the factor)."""
    per_head = n.double()[:, None] * full
    low, high = floor.double()[:, None].expand_as(shares), torch.ones_like(shares)

    def spent(factor: float) -> float:
        return float((torch.minimum(torch.maximum(shares * factor, low), high) * per_head).sum())

    lo, hi = 0.0, 1.0
    while spent(hi) < budget_bytes and hi < 1e12 and bool((shares * hi < 1).any()):
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) <= budget_bytes else (lo, mid)
    return torch.minimum(torch.maximum(shares * lo, low), high)


def floor_shares(
    n: torch.Tensor, least: int, full: int, slot: int, uniform: float = 0.0, budget_bytes: float = 0.0, heads: int = 1
) -> torch.Tensor:
    """(L,) the least byte share of a head holding n (L,): `least` plain tokens (slots included),
    and at least `uniform` of the share a uniform split of `budget_bytes` over `heads` per layer gives
    (dropped when, with the least tokens of short sliding layers, it would not fit the budget)."""
    tokens = torch.clamp(n, max=least).double() * (full + slot) / (n.clamp(min=1).double() * full)
    even = budget_bytes / max(float(n.sum()) * heads * full, 1e-30)
    floor = torch.maximum(tokens, torch.full_like(tokens, uniform * even)).clamp(max=1.0)
    if float((floor * n.double()).sum()) * heads * full > budget_bytes:  # the least tokens leave less to split
        floor = tokens.clamp(max=1.0)
    return floor


def tokens_kept(fractions: torch.Tensor, rooms: torch.Tensor, costs: Cost, least: int) -> torch.Tensor:
    """Tokens every head keeps at once: (b, L, h) tokens kept by heads with byte shares
    `fractions` (b, L, h) holding `rooms` (b, L) tokens, each at its own cost (`costs`: a
    `Cost.table` with fields (L, h)); a layer whose every head may hold all it has keeps everything
    (as `Plan.at`). What the cache asks at every decoding step, so one vectorised call."""
    n = rooms.unsqueeze(-1).expand_as(fractions)
    share = fractions.clamp(min=SHARE_RANGE[0], max=SHARE_RANGE[1])
    kept = torch.maximum(tokens_at_fraction(share, n, costs), n.clamp(max=least))
    whole = (fractions.min(-1).values >= 1.0).unsqueeze(-1)  # (b, L, 1)
    return torch.where(whole, n, kept)
