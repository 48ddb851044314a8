"""One method against the best other stack at each budget, with how sure the difference is.

A sweep's cells hold 3 to 30 samples each; one needle found or missed moves a task's mean by
1/samples, and the best of several stacks at a budget is partly the luckiest. So a comparison
pairs the two stacks' answers to the same questions (same task, sample and question) and
gives the mean difference over the tasks with a 95% paired bootstrap interval: the samples of
each task redrawn with replacement, `DRAWS` times. The rival is chosen on the same rows, which
favours it: an interval that holds 0 says the sweep cannot tell the two apart. With `held_out`
it is chosen as a user picks a stack, without the answers it is scored on: on each half of the
samples (even, odd), the stack best on the other half (cross-fitting; the two may differ).
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DRAWS = 2000
UNKNOWN = "a machine not recorded"  # rows stored before the store named the machine
Key = tuple[str, str, int]  # model, mode, length: a group of comparable cells


@dataclass(frozen=True)
class Comparison:
    """`method` against `rival` at `budget` of one group: their means over `tasks` (each task's
    mean, then the mean of those), the difference and its 95% interval, `pairs` questions."""

    group: Key
    budget: str
    method: str
    rival: str
    tasks: tuple[str, ...]
    score: float
    rival_score: float
    low: float
    high: float
    pairs: int
    machines: tuple[str, ...] = ()  # what computed the two stacks' rows (`store.machine`)
    full_bytes: tuple[float, ...] = ()  # each side's mean full-cache bytes (another dtype: other bytes)

    @property
    def same_bytes(self) -> bool:
        """Whether a fraction of the budget is the same bytes on both sides: their full caches
        within 5% of each other (a rival run in bf16 beside a float32 model holds half the bytes)."""
        return len(self.full_bytes) < 2 or max(self.full_bytes) <= 1.05 * min(self.full_bytes)

    @property
    def difference(self) -> float:
        return self.score - self.rival_score

    @property
    def verdict(self) -> str:
        """In words: better or worse when the interval excludes 0; alike when every answer
        scored the same; else the sweep cannot tell."""
        if self.low == self.high == 0.0:
            return "alike"
        return "better" if self.low > 0 else "worse" if self.high < 0 else "cannot tell"


Pairs = dict[str, list[tuple[float, float]]]  # per task, (method's score, rival's) per question
Scores = dict[tuple[str, str], dict[tuple[int, int], float]]  # per (stack, task), per (sample, question)


def paired(scores: Scores, a: str, b: str, tasks: Iterable[str]) -> Pairs:
    """Per task, the (a, b) scores of the questions both stacks answered."""
    out: Pairs = {}
    for task in tasks:
        mine, theirs = scores.get((a, task), {}), scores.get((b, task), {})
        out[task] = [(mine[k], theirs[k]) for k in sorted(mine.keys() & theirs.keys())]
    return out


def task_mean(pairs: Pairs, side: int) -> float:
    """The mean over tasks of each task's mean score on one side (0: the method, 1: the rival)."""
    return statistics.fmean(statistics.fmean(p[side] for p in rows) for rows in pairs.values())


def interval(pairs: Pairs, draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """95% paired bootstrap interval of the difference of `task_mean`s: each task's questions
    redrawn with replacement, the pairs kept together."""
    rng = random.Random(seed)
    diffs = {task: [a - b for a, b in rows] for task, rows in pairs.items()}
    means = []
    for _ in range(draws):
        means.append(statistics.fmean(statistics.fmean(rng.choices(d, k=len(d))) for d in diffs.values()))
    means.sort()
    return means[int(0.025 * (draws - 1))], means[int(0.975 * (draws - 1))]


def compare(
    rows: Iterable[dict[str, Any]],
    method: str,
    within: bool = True,
    held_out: bool = False,
    against: str | None = None,
) -> list[Comparison]:
    """Per group and budget where `method` ran, it against the other stack (not the full cache,
    nor the method with other settings: `auto(validate=0)` is no rival to `auto`) with the best
    mean over the tasks both ran on every question; with `within`, only stacks whose context
    bytes fit the budget (the fidelity rows' kv_ratio, when the sweep has them); with
    `held_out`, the best on the other half of the samples (`cross_fitted`). With `against`, that
    stack is the only rival, on the tasks it ran, at budget 1 too (where quantizers alone run; otherwise a budget of 1
    is every eviction stack's full cache, and skipped)."""
    scores: dict[Key, dict[str, Scores]] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    ratios: dict[tuple[Key, str, str], list[float]] = defaultdict(list)
    machines: dict[tuple[Key, str, str], set[str]] = defaultdict(set)
    full: dict[tuple[Key, str, str], list[float]] = defaultdict(list)
    for r in rows:
        group = (r["model"], r["mode"], r["length"])
        scores[group][r["budget"]][(r["method"], r["task"])][(r["sample"], r["question"])] = float(r["score"])
        machines[(group, r["budget"], r["method"])].add(r.get("machine") or UNKNOWN)
        if r.get("kv_bytes_full"):
            full[(group, r["budget"], r["method"])].append(float(r["kv_bytes_full"]))
        if r["task"] == "fidelity" and r["kv_ratio"] is not None:
            ratios[(group, r["budget"], r["method"])].append(float(r["kv_ratio"]))
    out = []
    for group in sorted(scores):
        for budget, cells in sorted(scores[group].items(), key=lambda kv: -_fraction(kv[0])):
            tasks = tuple(sorted({task for stack, task in cells if stack == method}))
            if against is not None:  # a named rival is met on the tasks it ran (kvpress runs no fidelity)
                tasks = tuple(t for t in tasks if (against, t) in cells)
            if not tasks or (budget == "1" and against is None):
                continue
            stacks = {stack for stack, _ in cells} - {method, "full"}
            rivals = [] if against is None else [against] if against in stacks else []
            for rival in sorted(stacks) if against is None else []:
                held = ratios.get((group, budget, rival))
                fat = within and held and max(held) > _fraction(budget) * 1.001
                if not rival.startswith(f"{method}(") and not fat:
                    rivals.append(rival)
            found = cross_fitted(cells, method, rivals, tasks) if held_out else best(cells, method, rivals, tasks)
            if found is None:
                continue
            stacks, pairs = found
            low, high = interval(pairs)
            count = sum(len(p) for p in pairs.values())
            means = task_mean(pairs, 0), task_mean(pairs, 1)
            ran = set().union(*(machines[(group, budget, m)] for m in (method, *stacks)))
            sizes = tuple(statistics.fmean(full[key]) for m in (method, *stacks) if full[key := (group, budget, m)])
            rival = " / ".join(stacks)
            c = Comparison(group, budget, method, rival, tasks, *means, low, high, count, tuple(sorted(ran)), sizes)
            out.append(c)
    return out


def best(scores: Scores, method: str, rivals: list[str], tasks: tuple[str, ...]) -> tuple[tuple[str], Pairs] | None:
    """The rival with the best mean over `tasks` on the questions it and `method` both answered
    (one that skipped a task, or was refused, is passed over), as a 1-tuple, and those pairs;
    None if none."""
    found: tuple[float, str, Pairs] | None = None
    for rival in rivals:
        pairs = paired(scores, method, rival, tasks)
        if any(not p for p in pairs.values()):
            continue
        mean = task_mean(pairs, 1)
        if found is None or mean > found[0]:
            found = (mean, rival, pairs)
    return None if found is None else ((found[1],), found[2])


def half(scores: Scores, parity: int) -> Scores:
    """The answers to the samples whose index has `parity` (0: even, 1: odd)."""
    return {cell: {k: v for k, v in answers.items() if k[0] % 2 == parity} for cell, answers in scores.items()}


def cross_fitted(
    scores: Scores, method: str, rivals: list[str], tasks: tuple[str, ...]
) -> tuple[tuple[str, ...], Pairs] | None:
    """The rival chosen without its scored answers: on each half of the samples, `best` on the
    other half, paired with `method` on this one; the stacks chosen (one or two, the halves may
    differ) and the pairs of both halves together. None when no half has a rival chosen."""
    names: list[str] = []
    pairs: Pairs = {task: [] for task in tasks}
    for parity in (0, 1):
        chosen = best(half(scores, 1 - parity), method, rivals, tasks)
        if chosen is None:
            continue
        (name,), _ = chosen
        scored = paired(half(scores, parity), method, name, tasks)
        if any(not p for p in scored.values()):
            continue
        names.append(name)
        for task in tasks:
            pairs[task] += scored[task]
    if not names:
        return None
    return tuple(dict.fromkeys(names)), pairs


def _fraction(budget: str) -> float:
    """A budget's fraction for ordering and fitting ('0.125'); other budgets (tokens, sizes) as 1."""
    try:
        return float(budget)
    except ValueError:
        return 1.0
