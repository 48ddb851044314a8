"""`kvstack train`: teacher scores on prose, a fit per head, a held-out check, one saved file."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvstack.cache.statistics import HORIZON
from kvstack.calibrate.heads import query_groups
from kvstack.calibrate.prose import calibration_ids
from kvstack.calibrate.store import Ticker, calibration_dir, model_key
from kvstack.errors import UserError, unknown_name
from kvstack.methods.learned import sink_attention
from kvstack.methods.learned.features import FEATURE_SETS
from kvstack.methods.learned.files import predictor_path
from kvstack.methods.learned.predictor import Predictor
from kvstack.training.fit import fit_layers, fit_sink_attention, kept_overlap
from kvstack.training.teachers import TEACHERS, cached_scores, check_teacher, prefill, student_inputs

# learned scorer -> its default teacher (its outputs' width)
TRAINABLE = {"kvzap": "kvzip", "retention": "decay", "wgkv": "kvzip", "sinkgate": "kvzip"}
# learned scorer -> the features it reads by default: retention's gate reads a token as it is
# written (its age enters through its decay alone), kvzap's reads its neighbours and age too,
# wgkv's write gate the token alone (its key and value over their RMS)
READS = {"kvzap": "local", "retention": "kv", "wgkv": "gate", "sinkgate": "gate"}
SINK_ATTENTION = {"sinkgate"}  # scorers whose network is Fast KVzip's sink attention (`hidden` its rank), not an MLP
# the network each scorer ships with, so `kvstack train NAME` rebuilds it: hidden width (0: linear;
# sinkgate: its rank) and steps (sinkgate: mini-batches of 1024 tokens); others 0 and 400
HIDDEN = {"wgkv": 32, "sinkgate": sink_attention.RANK}
STEPS = {"sinkgate": 1200}
FRACTIONS = (0.125, 0.25)  # held-out check: the teacher's kept set at these budgets


@dataclass
class Trained:
    """A trained predictor, where it was saved and what it scored on rows it never saw."""

    predictor: Predictor | sink_attention.SinkAttention
    path: Path
    held_out: dict[str, float]  # "kept@0.125": share of the teacher's kept tokens the predictor keeps too
    teacher_s: float  # seconds scoring with the teacher (an earlier run's scores are read) and reading inputs
    fit_s: float


def train(
    model: Any,
    method: str = "kvzap",
    teacher: str | None = None,
    texts: int = 16,
    held: int = 2,
    tokens: int = 1024,
    hidden: int | None = None,
    steps: int | None = None,
    out: Path | None = None,
    features: str | None = None,
) -> Trained:
    """Train `method`'s predictor for `model` on `texts` State of the Union rows of `tokens` tokens
    scored by `teacher`, check it on `held` other rows, save it (`out`, else where `kvzap` finds it).
    The predictor reads the `features` set named (default: the method's, READS)."""
    if method not in TRAINABLE:
        raise unknown_name("trainable method", method, list(TRAINABLE))
    teacher = check_teacher(teacher or TRAINABLE[method])
    outputs = TEACHERS[TRAINABLE[method]]  # per KV head
    if TEACHERS[teacher] != outputs:
        fits = [name for name, o in TEACHERS.items() if o == outputs]
        gives = f"teacher {teacher} gives {TEACHERS[teacher]}"
        raise UserError(f"{method} learns {outputs} output(s) per head, {gives}: use {', '.join(fits)}")
    hidden = HIDDEN.get(method, 0) if hidden is None else hidden
    steps = STEPS.get(method, 400) if steps is None else steps
    if texts < 1 or held < 1 or tokens < 32 or hidden < 0 or steps < 1 or (method in SINK_ATTENTION and hidden < 1):
        fix = "texts >= 1 rows, held >= 1 held-out rows, tokens >= 32, hidden >= 0 (sinkgate: >= 1), steps >= 1"
        raise UserError(f"train on {fix}")
    features = features or READS[method]
    if features not in FEATURE_SETS:
        raise unknown_name("feature set", features, list(FEATURE_SETS))
    key = model_key(model)
    rows = calibration_ids(model, texts, tokens, skip=held)  # the held-out rows are the newest addresses
    checks = calibration_ids(model, held, tokens)
    folder = calibration_dir() / "scores" / f"{key}-{tokens}"
    started = time.monotonic()
    targets, inputs = [], []
    with torch.no_grad(), Ticker(f"{method}: {teacher} scores and inputs", len(rows) + len(checks)) as ticker:
        for ids in rows + checks:
            targets.append(cached_scores(model, ids, teacher, folder))  # per layer (h, n_l)
            row = student_inputs(prefill(model, ids), features)  # per layer (h, n_l, F)
            inputs.append([torch.cat([x] * outputs) for x in row])  # (o*h, n_l, F)
            ticker.advance()
    teacher_s = time.monotonic() - started
    started = time.monotonic()
    xs = [torch.cat([row[i] for row in inputs[: len(rows)]], 1) for i in range(len(inputs[0]))]
    ys = [torch.cat([row[i] for row in targets[: len(rows)]], 1) for i in range(len(targets[0]))]
    with Ticker(f"{method}: fitting {len(xs)} x {xs[0].shape[0]} heads", steps) as ticker:

        def progress(k: int) -> None:
            ticker.advance(k - ticker.done)

        if method in SINK_ATTENTION:
            gates = partial(fit_sink_attention, groups=query_groups(model))
            predictor = fit_layers(xs, ys, hidden, gates, steps=steps, progress=progress)
        else:
            predictor = fit_layers(xs, ys, hidden, steps=steps, progress=progress, units=outputs > 1)
    fit_s = time.monotonic() - started
    held_out = check(predictor, inputs[len(rows) :], targets[len(rows) :], final_score(method))
    predictor.meta = {
        "method": method,
        "model_key": key,
        "model": getattr(model, "kvstack_name", ""),
        "teacher": teacher,
        "features": features,
        "horizon": "" if teacher == "kvzip" else str(HORIZON),
        "texts": str(texts),
        "tokens": str(tokens),
        "hidden": str(hidden),
        "steps": str(steps),
        "held_out": json.dumps(held_out),
    }
    path = out or predictor_path(key, method)
    try:
        predictor.save(path)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}; give --out a writable path") from None
    return Trained(predictor, path, held_out, teacher_s, fit_s)


def final_score(method: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """How `method` ranks a row's tokens at its end from its outputs (o*h, n) -> (h, n): kvzap's
    score as it is; retention's scale plus decay times each token's age."""
    if method != "retention":
        return lambda y: y
    from kvstack.methods.learned.retention import retained

    def at_end(y: torch.Tensor) -> torch.Tensor:
        scale, decay = y.chunk(2)
        age = torch.arange(y.shape[-1], 0, -1, dtype=y.dtype)  # the next query is 1 after the last token
        return retained(scale, decay, age)

    return at_end


def check(
    predictor: Predictor | sink_attention.SinkAttention,
    inputs: list[list[torch.Tensor]],
    targets: list[list[torch.Tensor]],
    final: Callable[[torch.Tensor], torch.Tensor] = lambda y: y,
) -> dict[str, float]:
    """Mean over rows and layers of `kept_overlap` at each of FRACTIONS: per row, per layer inputs
    (o*h, n_l, F) and targets (o*h, n_l), both ranked by `final` (o*h, n) -> (h, n). The first 4
    tokens (kept by every scorer) are left out."""
    out = {}
    for fraction in FRACTIONS:
        shares = []
        for row_x, row_y in zip(inputs, targets, strict=True):
            for i, (x, y) in enumerate(zip(row_x, row_y, strict=True)):
                mine, theirs = final(predictor.predict(i, x[None])[0]), final(y)
                shares.append(kept_overlap(mine[..., 4:], theirs[..., 4:], fraction))
        out[f"kept@{fraction:g}"] = sum(shares) / len(shares)
    return out
