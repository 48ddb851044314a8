"""Validation: every candidate decision executed by the cache on held-out text, scored by how
far it moves the model's next-token predictions from the full cache's where the model
continues the text and where it answers questions about it.

The curves judge a head by its attention output and add heads up as if their errors were
independent; what a user sees is what the model then says. So `auto` decides among
candidates, each a set of options the solver may use: the rate-distortion plan with each
scorer (over several at once with `mix`), and every uniform stack (one scorer, one storage, an
equal share per head: what a hand-picked stack does). Each is executed at budgets of 1/2 to
1/64 of the full bytes on rows the curves did not see; at a budget, `auto` executes the
candidate that moved the model least at the nearest of them (`ranking`).

Probes are what users ask of a context: its continuation (a quarter of the loss, as fidelity
is one task of four in the benchmark) and keyed facts written into it, each asked for by its
key (" Hana's safe code is 418203." ... "What is Hana's safe code?"), among look-alikes (Hana's
locker code, Emil's safe code), as a multi-key needle test's distractors are, a fact counting up
to its first wrong token, as greedy decoding answers (`per_probe`). Rows start as the model's
prompts do (Gemma 3's BOS), and every other row is RULER's filler instead of prose, a context
holding little but its facts, as a needle test's does: on prose alone no candidate kept a fact
at 1/16 of Gemma 3's bytes, the continuation decided, and SnapKV won and found no needle.
Random spans recalled after the words before them (the curves' probes) misled the same way:
they stand out to SnapKV's observation window.

Ranked by agreement with the full cache's top-1, which greedy answers and the benchmark count,
then by KL(full || compressed) among those within `TIE` of the best: agreement alone is
noisy (it once ranked SnapKV's plan over KVzip's on SmolLM2 at 1/8 by 0.895 against 0.893, a
plan that loses needles; their KLs, 0.39 against 0.11, did not), KL alone prefers a spread
distribution to a peaked one that is right more often (Gemma 3 at 1/32: SnapKV's plan KL 1.77
with 0.32 agreeing, uniform KVzip at 2 bits KL 1.90 with 0.45).
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


NAMES = ("Ada", "Boris", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kiri", "Lena")
THINGS = ("locker", "safe", "gate", "mailbox", "alarm", "bike lock")
FACTS = 8  # keyed facts per validation row (one per 128 tokens in shorter rows): 64 in eight rows
KEY, CODE = 4, 6  # ids of a fact's key (half its owner, half its thing) and code without a tokenizer
CONTINUATION = 0.25  # weight of the continuation in a candidate's loss; the facts share the rest
TIE = 0.02  # agreements closer than this (9 code tokens of the ~440 in eight rows) are ranked by KL


def look_alike_keys(count: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """`count` distinct (owner, thing) index pairs, each owner holding two things and the same
    two things held by every owner, in random order: every key has look-alikes that share a
    part of it, as the distractor needles of a multi-key test share its form."""
    owners = torch.randperm(len(NAMES), generator=generator)[: (count + 1) // 2].tolist()
    things = torch.randperm(len(THINGS), generator=generator)[:2].tolist()
    pairs = [(o, t) for o in owners for t in things]
    return [pairs[i] for i in torch.randperm(len(pairs), generator=generator)[:count].tolist()]


def fact_probes(
    row: torch.Tensor, tokens: int, encode: Callable[[str], list[int]] | None, generator: torch.Generator
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """(context (tokens,), probes, answers): the row's first `tokens` ids with `FACTS` keyed
    facts written at even intervals (" Hana's safe code is 418203."), their keys look-alikes
    (`look_alike_keys`: Hana's locker code is there too, and Emil's safe code); probes: the
    row's own continuation, then per fact its question ("What is Hana's safe code? Hana's safe
    code is") and code; answers: how many of each probe's last ids are scored. Without a
    tokenizer a key is random owner ids then random thing ids, shared the same way, and its
    probe repeats key and code."""
    context = row[:tokens].clone()
    probes, answers = [row[tokens:]], [len(row) - tokens - 1]
    keys = look_alike_keys(max(1, min(FACTS, tokens // 128)), generator)
    if encode is None:  # random ids for every owner and thing
        parts = row[torch.randint(0, tokens, (len(NAMES) + len(THINGS), KEY // 2), generator=generator)]
    for i, (owner, thing) in enumerate(keys):
        at = tokens * (i + 1) // (len(keys) + 1)
        if encode is None:
            key = [*parts[owner].tolist(), *parts[len(NAMES) + thing].tolist()]
            code = row[torch.randint(0, tokens, (CODE,), generator=generator)].tolist()
            fact, question = key + code, key
        else:
            digits = torch.randint(0, 10, (CODE,), generator=generator)
            name, what, number = NAMES[owner], THINGS[thing], "".join(str(int(d)) for d in digits)
            fact = encode(f" {name}'s {what} code is {number}.")
            question = encode(f"\n\nWhat is {name}'s {what} code? {name}'s {what} code is")
            code = encode(f" {number}")
        context[at : at + len(fact)] = torch.tensor(fact)
        probes.append(torch.tensor([*question, *code]))
        answers.append(len(code))
    return context, probes, answers


def validation_rows(model: Any, rows: int, length: int, skip: int) -> list[torch.Tensor]:
    """`rows` rows of `length` ids: calibration prose after the `skip` rows the curves read, every
    other one RULER's filler instead when the model has a tokenizer (random ids have no filler)."""
    from kvstack.calibrate.prose import calibration_ids

    encode = getattr(model, "_kvstack_encode", None)
    prose = calibration_ids(model, rows, length, skip=skip)
    filler = filler_ids(model, encode, length) if encode else None  # the same ids for every filler row
    return [filler if r % 2 and filler is not None else row for r, row in enumerate(prose)]


def filler_ids(model: Any, encode: Callable[[str], list[int]], length: int) -> torch.Tensor:
    """(length,) ids of RULER's filler sentences repeated, after the model's BOS: a context
    holding little but its facts, as a needle test's haystack does."""
    from kvstack.bench.tasks.ruler import NOISE
    from kvstack.calibrate.prose import prompt_prefix

    ids = encode(" " + NOISE)
    return torch.tensor(prompt_prefix(model) + ids * (length // len(ids) + 1))[:length]


def scored_positions(probes: list[torch.Tensor], answers: list[int]) -> list[torch.Tensor]:
    """Per probe, the positions of the probes laid end to end whose next-token predictions are
    scored: those of the probe's last `answers[i]` ids (a continuation's all but its first, a
    fact's code)."""
    out, start = [], 0
    for probe, n in zip(probes, answers, strict=True):
        end = start + len(probe)
        out.append(torch.arange(end - n - 1, end - 1))
        start = end
    return out


def per_probe(kl: torch.Tensor, agree: torch.Tensor, at: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(P, 2) per probe, its mean KL and its agreement, from kl and agree (k,) per scored position
    and `at`, each probe's indices in them, the continuation first. The continuation's agreement
    is the share of its positions whose top-1 agrees (as fidelity counts it); a fact's, the share
    of its code before the first that does not, as greedy decoding would answer it (teacher
    forcing credits the digits after a miss that greedy never reaches: uniform KVzip with 1-bit
    values agreed on 0.73 of Gemma 3's code tokens at 1/8 and answered no needle at all)."""
    rows = [
        torch.stack([kl[i].mean().double(), (agree[i] if p == 0 else agree[i].cumprod(0)).mean().double()])
        for p, i in enumerate(at)
    ]
    return torch.stack(rows)


def loss(table: torch.Tensor) -> torch.Tensor:
    """(..., 2) weighted (KL, top-1 agreement) from table (..., P, 2) of per-probe values, the
    continuation first: it weighs `CONTINUATION`, the facts share the rest (fidelity is one task
    of four in the benchmark's mean, retrieval and QA the other three)."""
    return CONTINUATION * table[..., 0, :] + (1 - CONTINUATION) * table[..., 1:, :].mean(-2)


def ranking(table: torch.Tensor) -> torch.Tensor:
    """(C,) candidate indices, best first, from table (C, P, 2) of per-probe (KL, top-1
    agreement), both weighted by `loss`: the candidates whose agreement is within `TIE` of the
    best, by lowest KL; then the others by agreement; refused ones (inf KL) last; ties by index."""
    kl, agree = loss(table).unbind(-1)
    fits = torch.isfinite(kl)
    best = float(agree[fits].max()) if bool(fits.any()) else 0.0

    def key(c: int) -> tuple[bool, bool, float, int]:
        tied = bool(fits[c]) and float(agree[c]) >= best - TIE
        return not bool(fits[c]), not tied, float(kl[c]) if tied else -float(agree[c]), c

    return torch.tensor(sorted(range(len(kl)), key=key))


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
    """(G, C, P, 2) per budget in `GRID`, candidate and probe, the mean over `rows` validation rows
    (after the `skip` the curves read) of KL(full || compressed) of the next-token distributions
    at the probe's scored positions and the agreement of their top tokens (`per_probe`); KL inf
    where the cache refuses the candidate at that budget. stack_of(fraction, candidate): the
    stack executing that decision; candidates it gives the same stack object are run once (a
    32-token window the budget cannot pay for leaves a plain plan, the same for every width)."""
    from kvstack.cache.cache import KVCache
    from kvstack.generate import Runner
    from kvstack.stack import Stack

    encode = getattr(model, "_kvstack_encode", None)
    generator = torch.Generator().manual_seed(1)
    out: torch.Tensor | None = None
    for row in validation_rows(model, rows, tokens + FOLLOW, skip):
        if len(row) < tokens + FOLLOW:
            raise UserError(
                f"auto validates on rows of {tokens + FOLLOW} tokens, a calibration text has {len(row)}: "
                "use auto(tokens=...) with fewer tokens"
            )
        context, probes, answers = fact_probes(row, tokens, encode, generator)
        source = Runner(model, KVCache(model, "full", 1.0, observe=needs, query_window=window))
        source.forward(context[None], torch.ones(1, tokens, dtype=torch.long))
        follow = torch.cat(probes)[None]
        ones = torch.ones_like(follow)
        scored = scored_positions(probes, answers)
        keep = torch.cat(scored)  # logits only where a probe is scored (Gemma 3's vocabulary is 262k)
        at = torch.arange(len(keep)).split([len(i) for i in scored])  # each probe's rows of those logits
        if out is None:
            out = torch.zeros(len(GRID), len(choices), len(probes), 2, dtype=torch.float64)
        full = source.fork(Stack.parse("full"), Budget.parse(1.0)).forward(follow, ones, keep)[0]
        reference = torch.log_softmax(full, -1)
        if ticker is not None:
            ticker.advance()
        for g, fraction in enumerate(GRID):
            ran: dict[int, torch.Tensor | None] = {}  # per stack run at this budget: its table, None if refused
            for c, choice in enumerate(choices):
                stack = stack_of(fraction, choice)
                if id(stack) not in ran:
                    ran[id(stack)] = _probe_table(source, stack, fraction, follow, ones, keep, reference, at)
                table = ran[id(stack)]
                if table is None:
                    out[g, c, :, 0] = math.inf
                else:
                    out[g, c] += table / rows
                if ticker is not None:
                    ticker.advance()
    assert out is not None
    return out


def _probe_table(
    source: Any,
    stack: Any,
    fraction: float,
    follow: torch.Tensor,
    ones: torch.Tensor,
    keep: torch.Tensor,
    reference: torch.Tensor,
    at: tuple[torch.Tensor, ...],
) -> torch.Tensor | None:
    """(P, 2) `per_probe` of `stack` forked from the full cache `source` at `fraction` and fed the
    probes `follow` (1, k), against the full cache's log-probabilities; None when it is refused."""
    from kvstack.generate import divergence

    try:
        runner = source.fork(stack, Budget.parse(fraction))
        logp = torch.log_softmax(runner.forward(follow, ones, keep)[0], -1)
        return per_probe(*divergence(reference, logp), at).cpu()
    except UserError:
        return None
