"""Validation: every candidate decision executed by the cache on held-out prose, scored by how
far it moves the model's next-token distributions from the full cache's on the curves' probes.

The curves judge a head by its attention output and add heads up as if their errors were
independent; what a user sees is what the model then says. Measured on Gemma 3 270M at 2k,
the rate-distortion plan over KVzip moved the recall probes' predictions 5 times more than a
uniform SnapKV stack of the same bytes (KL 0.45 against 0.09 at 1/4). So `auto` decides among
candidates, each a set of options the solver may use: the rate-distortion plan with each
scorer (over several at once with `mix`), and every uniform stack (one scorer, one storage, an
equal share per head: what a hand-picked stack does). Each is executed at budgets of 1/2 to
1/64 of the full bytes on rows the curves did not see; at a budget, `auto` executes the
candidate with the lowest mean KL(full || compressed) over the probes at the nearest of them
(the continuation counts as much as each recall, as fidelity counts as much as each retrieval
task in the benchmark). Top-1 agreement is kept and shown, not ranked on: measured on SmolLM2,
it ranked SnapKV's plan above KVzip's at 1/8 (recall 0.88 against 0.89, continuation 0.94
against 0.90), a plan that loses needles; their KLs on the recalls, 0.39 against 0.11, do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import torch

from kvstack.cache.budget import Budget
from kvstack.errors import UserError

GRID = tuple(2.0**-k for k in range(1, 7))  # byte fractions the candidates are validated at
FOLLOW = 32  # continuation tokens after each validation row's context


@dataclass(frozen=True)
class Candidate:
    """Options one decision may use: `scorers` (eviction methods, one per layer), `storages`
    (per head), every head at least `uniform` of a uniform split (1.0: exactly that split)."""

    scorers: tuple[str, ...]
    storages: tuple[str, ...]
    uniform: float

    @property
    def is_uniform(self) -> bool:
        return self.uniform >= 1.0 and len(self.scorers) == 1 and len(self.storages) == 1

    def __str__(self) -> str:
        if self.is_uniform:
            return f"{self.scorers[0]} at {self.storages[0]} in every head"
        return f"rate-distortion over {'+'.join(self.scorers)}"


def candidates(
    scorers: tuple[str, ...], storages: tuple[str, ...], uniform: float, mix: bool = False
) -> list[Candidate]:
    """The rate-distortion decision with each scorer (with `mix`, over every subset of several
    scorers too, all of them first, each layer taking its own), then every uniform stack: each
    scorer with each storage (once: a plan with no choice left is one of them)."""
    sizes = range(len(scorers), 0, -1) if mix else [1]
    planned = [Candidate(subset, storages, uniform) for size in sizes for subset in combinations(scorers, size)]
    found = planned + [Candidate((s,), (q,), 1.0) for s in scorers for q in storages]
    return list(dict.fromkeys(found))


def nearest(fraction: float, grid: tuple[float, ...]) -> int:
    """Index of the budget in `grid` nearest to `fraction` (on a log scale)."""
    return min(range(len(grid)), key=lambda i: abs(math.log2(grid[i]) - math.log2(fraction)))


def scored_positions(probes: list[torch.Tensor], needle: int) -> list[torch.Tensor]:
    """Per probe, the positions of the probes laid end to end whose next-token predictions are
    scored: the continuation's own tokens, and a recall probe's last `needle` ids (the span)."""
    out, start = [], 0
    for i, probe in enumerate(probes):
        end = start + len(probe)
        out.append(torch.arange(start, end - 1) if i == 0 else torch.arange(end - needle - 1, end - 1))
        start = end
    return out


def ranking(table: torch.Tensor) -> torch.Tensor:
    """(C,) candidate indices, best first, from table (C, P, 2) of per-probe (KL, top-1
    agreement): lowest mean KL, then highest mean agreement, then the earlier candidate;
    candidates refused (inf KL) last."""
    kl, agree = table[..., 0].mean(-1), table[..., 1].mean(-1)
    return torch.tensor(sorted(range(len(kl)), key=lambda c: (float(kl[c]), -float(agree[c]), c)))


def losses(
    model: Any,
    stack_of: Callable[[float, Candidate], Any],
    choices: list[Candidate],
    rows: int,
    skip: int,
    tokens: int,
    needs: frozenset[str],
    window: int,
    ticker: Any = None,
) -> torch.Tensor:
    """(G, C, P, 2) per budget in `GRID`, candidate and probe, the mean over `rows` rows of
    calibration prose (after the `skip` the curves read) of KL(full || compressed) of the
    next-token distributions at the probe's scored positions, and the share of them whose top
    token agrees with the full cache's; KL inf where the cache refuses the candidate at that
    budget. stack_of(fraction, candidate): the stack executing that decision."""
    from kvstack.cache.cache import KVCache
    from kvstack.calibrate.prose import calibration_ids
    from kvstack.generate import _Runner, divergence
    from kvstack.planning.curves import NEEDLE, probe_set
    from kvstack.stack import Stack

    _, part = getattr(model, "_kvstack_repeat_ids", ([], []))
    generator = torch.Generator().manual_seed(1)
    out: torch.Tensor | None = None
    for row in calibration_ids(model, rows, tokens + FOLLOW, skip=skip):
        if len(row) < tokens + FOLLOW:
            raise UserError(
                f"auto validates on rows of {tokens + FOLLOW} tokens, a calibration text has {len(row)}: "
                "use auto(tokens=...) with fewer tokens"
            )
        context, probes = probe_set(row, tokens, list(part), generator)
        source = _Runner(model, KVCache(model, "full", 1.0, observe=needs, query_window=window))
        source.forward(context[None], torch.ones(1, tokens, dtype=torch.long))
        follow = torch.cat(probes)[None]
        ones = torch.ones_like(follow)
        at = scored_positions(probes, NEEDLE)
        if out is None:
            out = torch.zeros(len(GRID), len(choices), len(probes), 2, dtype=torch.float64)
        full = source.fork(Stack.parse("full"), Budget.parse(1.0)).forward(follow, ones, every_position=True)[0]
        reference = torch.log_softmax(full, -1)
        if ticker is not None:
            ticker.advance()
        for g, fraction in enumerate(GRID):
            for c, choice in enumerate(choices):
                try:
                    runner = source.fork(stack_of(fraction, choice), Budget.parse(fraction))
                    logp = torch.log_softmax(runner.forward(follow, ones, every_position=True)[0], -1)
                    kl, agree = divergence(reference, logp)
                    for p, i in enumerate(at):
                        out[g, c, p] += torch.stack([kl[i].mean().double(), agree[i].mean()]).cpu() / rows
                except UserError:
                    out[g, c, :, 0] = math.inf
                if ticker is not None:
                    ticker.advance()
    assert out is not None
    return out
