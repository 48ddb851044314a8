"""Teacher scores and student inputs on training text: what a learned scorer is fitted to.

A teacher scores every token of a prose row once, the expensive way; a student sees only each
token's key before RoPE and its value. `kvzip`: KVzip's reconstruction score (the most
attention a query repeating the context gives the token), as `kvzip` computes it, in log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvstack.cache.cache import KVCache
from kvstack.errors import UserError, unknown_name
from kvstack.generate import Runner
from kvstack.methods.learned.predictor import features
from kvstack.models.rope import rotate

TEACHERS = ("kvzip",)
FLOOR = 1e-6  # scores below this are equal (log floor)


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


def student_inputs(cache: KVCache) -> list[torch.Tensor]:
    """Per layer (h, n, 2d + 4) float32 on the CPU: each token's `features` (key before RoPE, value, how
    it stands among the head's tokens), for a
    full cache holding one row from position 0."""
    out = []
    for layer in cache.layers:
        keys = torch.stack([layer.head_keys(h)[0] for h in range(layer.n_kv_heads)]).float()  # (h, n, d)
        values = torch.stack([layer.head_values(h)[0] for h in range(layer.n_kv_heads)]).float()
        if layer.inv_freq is not None:
            positions = torch.arange(keys.shape[1], device=keys.device).float()
            keys = rotate(keys, -positions.expand(keys.shape[0], -1), layer.inv_freq)
        out.append(features(keys, values).cpu())
    return out


def teacher_scores(model: Any, ids: torch.Tensor, teacher: str) -> list[torch.Tensor]:
    """Per layer (h, n_l) float32: the teacher's log score of each token a full cache holds after
    the row `ids` (n,): n_l = n, or a sliding-window layer's window."""
    check_teacher(teacher)
    cache = prefill(model, ids, observe=frozenset({"reconstruction"}))
    per_layer = [torch.stack([s[0] for s in layer.stats["reconstruction"]]) for layer in cache.layers]
    return [scores.float().clamp(min=FLOOR).log().cpu() for scores in per_layer]


def cached_scores(model: Any, ids: torch.Tensor, teacher: str, folder: Path) -> list[torch.Tensor]:
    """`teacher_scores`, kept in `folder` under the row's hash: a training run that stopped
    resumes at the first row it had not scored."""
    import hashlib

    name = hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16]
    path = folder / f"{teacher}-{name}.pt"
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
