"""Teacher scores and student inputs on training text: what a learned scorer is fitted to.

A teacher scores every token of a prose row once, the expensive way; a student sees only each
token's key before RoPE and its value. Teachers, each a per-layer (o*h, n_l) target of o outputs:
- `kvzip` (o = 1): KVzip's reconstruction score (the most attention a query repeating the
  context gives the token), as `kvzip` computes it, in log;
- `future` (o = 1): the mean log attention the next HORIZON tokens' queries give it (the future
  utility TokenButler and learned retention learn), averaged over the head's group;
- `decay` (o = 2): the least-squares line of that log attention by age (1 to HORIZON), its
  intercept for every head, then its slope (learned retention's geometric decay).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvstack.cache.cache import KVCache
from kvstack.cache.statistics import FLOOR, FUTURE, HORIZON
from kvstack.errors import UserError, unknown_name
from kvstack.generate import Runner
from kvstack.methods.learned.features import features
from kvstack.models.rope import rotate

TEACHERS = {"kvzip": 1, "future": 1, "decay": 2}  # name -> outputs per KV head


def check_teacher(name: str) -> str:
    """`name` when it is a known teacher, else a one-line error naming the closest."""
    if name not in TEACHERS:
        raise unknown_name("teacher", name, list(TEACHERS))
    return name


def prefill(model: Any, ids: torch.Tensor, observe: frozenset[str] = frozenset()) -> KVCache:
    """A full cache after one row `ids` (n,), with the statistics in `observe` recorded (their
    passes over the prompt, KVzip's re-reading, run by the loop's hooks)."""
    cache = KVCache(model, "full", 1.0, observe=observe)
    runner = Runner(model, cache)
    runner.forward(ids[None], torch.ones(1, ids.shape[0], dtype=torch.long))
    return cache


def student_inputs(cache: KVCache, kind: str = "local") -> list[torch.Tensor]:
    """Per layer (h, n, F) float32 on the CPU: each token's `features` of the set `kind` (key
    before RoPE, value, how it stands among the head's tokens...), for a full cache holding one
    row from position 0, the next query just after it."""
    out = []
    for layer in cache.layers:
        keys = torch.stack([layer.head_keys(h)[0] for h in range(layer.n_kv_heads)]).float()  # (h, n, d)
        values = torch.stack([layer.head_values(h)[0] for h in range(layer.n_kv_heads)]).float()
        # a sliding layer holds the row's last tokens: positions start..seen
        positions = torch.arange(layer.seen - keys.shape[1], layer.seen, device=keys.device).float()
        if layer.inv_freq is not None:
            keys = rotate(keys, -positions.expand(keys.shape[0], -1), layer.inv_freq)
        ages = (layer.seen - positions).expand(keys.shape[0], -1)
        out.append(features(keys, values, None, ages, kind).cpu())
    return out


def teacher_scores(model: Any, ids: torch.Tensor, teacher: str) -> list[torch.Tensor]:
    """Per layer (o*h, n_l) float32: the teacher's o targets for each token a full cache holds
    after the row `ids` (n,): n_l = n, or a sliding-window layer's window."""
    check_teacher(teacher)
    if teacher == "kvzip":
        cache = prefill(model, ids, observe=frozenset({"reconstruction"}))
        per_layer = [torch.stack([s[0] for s in layer.stats["reconstruction"]]) for layer in cache.layers]
        return [scores.float().clamp(min=FLOOR).log().cpu() for scores in per_layer]
    cache = prefill(model, ids, observe=FUTURE)
    out = []
    for layer in cache.layers:
        stat = {name: torch.stack([s[0] for s in layer.stats[name]]).float().cpu() for name in FUTURE}
        if teacher == "decay":
            out.append(torch.cat(log_line(stat["future_count"], stat["future_log"], stat["future_log_age"])))
        else:
            out.append(future_mean(stat))
    return out


def future_mean(stat: dict[str, torch.Tensor]) -> torch.Tensor:
    """(h, n) mean log attention over each token's next queries; a token with none (the row's
    last) takes its head's lowest."""
    count, logs = stat["future_count"], stat["future_log"]
    mean = logs / count.clamp(min=1)
    low = mean.masked_fill(count == 0, float("inf")).amin(-1, keepdim=True)
    return torch.where(count > 0, mean, low)


def log_line(count: torch.Tensor, logs: torch.Tensor, logs_age: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(intercept, slope) (h, n) of the least-squares line log p = a + b * age over each token's
    `count` queries aged 1..count (sums of log p and of age * log p given). One query gives a flat
    line; none, the head's lowest intercept and no slope."""
    m = count
    s1, s2 = m * (m + 1) / 2, m * (m + 1) * (2 * m + 1) / 6  # sums of age and age^2 over 1..m
    spread = m * s2 - s1 * s1  # m^2 times the ages' variance: 0 for m <= 1
    slope = torch.where(spread > 0, (m * logs_age - s1 * logs) / spread.clamp(min=1e-9), torch.zeros_like(m))
    intercept = (logs - slope * s1) / m.clamp(min=1)
    low = intercept.masked_fill(m == 0, float("inf")).amin(-1, keepdim=True)
    return torch.where(m > 0, intercept, low), slope


def cached_scores(model: Any, ids: torch.Tensor, teacher: str, folder: Path) -> list[torch.Tensor]:
    """`teacher_scores`, kept in `folder` under the row's hash: a training run that stopped
    resumes at the first row it had not scored."""
    import hashlib

    name = hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16]
    what = teacher if teacher == "kvzip" else f"{teacher}{HORIZON}"  # the future teachers read HORIZON queries
    path = folder / f"{what}-{name}.pt"
    if path.exists():
        try:
            return list(torch.load(path, weights_only=True))
        except (OSError, RuntimeError, EOFError, ValueError):
            pass  # a file cut short by a stop: score the row again
    scores = teacher_scores(model, ids, teacher)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        torch.save(scores, tmp)
        tmp.replace(path)
    except OSError as e:
        fix = "set KVSTACK_CALIBRATION to a writable folder"
        raise UserError(f"cannot keep teacher scores in {folder}: {e.strerror}; {fix}") from None
    return scores
