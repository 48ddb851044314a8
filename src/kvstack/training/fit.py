"""Fitting one small network per (layer, KV head) to teacher scores, all heads at once.

Every head's data has the same tokens, so the heads train as one batch: x (L, h, N, F),
y (L, h, N). Features are standardised per head; targets too (a score's scale does not matter,
only its order within the head), unless `units` asks for predictions in the targets' own units
(learned retention adds its scale and its decay times the age: their units matter). A linear head
is solved exactly (ridge); an MLP head by Adam on random mini-batches of tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvstack.methods.learned.predictor import Predictor, forward

RIDGE = 1e-3  # ridge penalty of the exact linear fit, relative to the features' unit variance


def standardise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, mean, std): x (..., N, F) with zero mean and unit spread per feature over N."""
    mean, std = x.mean(-2), x.std(-2).clamp(min=1e-6)
    return (x - mean[..., None, :]) / std[..., None, :], mean, std


def fit(
    x: torch.Tensor,
    y: torch.Tensor,
    hidden: int,
    steps: int = 400,
    batch: int = 4096,
    lr: float = 3e-3,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    units: bool = False,
) -> Predictor:
    """A predictor of y (L, h, N) from x (L, h, N, F): linear when `hidden` is 0, else a 2-layer MLP
    of that width trained for `steps` mini-batches of `batch` tokens. `progress(k)` after k steps.
    Its scores are standardised per head, or in y's units with `units`."""
    z, mean, std = standardise(x.float())
    y_mean, y_std = y.float().mean(-1), y.float().std(-1).clamp(min=1e-6)  # (L, h)
    target = (y.float() - y_mean[..., None]) / y_std[..., None]
    if not units:
        y_mean, y_std = torch.zeros_like(y_mean), torch.ones_like(y_std)
    big_l, h, _, f = z.shape
    if hidden == 0:
        gram = z.transpose(-1, -2) @ z + RIDGE * z.shape[-2] * torch.eye(f)  # (L, h, F, F)
        w = torch.linalg.solve(gram, z.transpose(-1, -2) @ target[..., None])  # (L, h, F, 1)
        empty = torch.zeros(big_l, h, 0)
        if progress is not None:
            progress(steps)
        return Predictor(w * y_std[..., None, None], empty, empty, y_mean, mean, std)
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(big_l, h, f, hidden, generator=gen) / f**0.5).requires_grad_()
    b1 = torch.zeros(big_l, h, hidden, requires_grad=True)
    w2 = (torch.randn(big_l, h, hidden, generator=gen) / hidden**0.5).requires_grad_()
    b2 = torch.zeros(big_l, h, requires_grad=True)
    params = [w1, b1, w2, b2]
    optimiser = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, steps)
    n = z.shape[-2]
    size, at = min(batch, n), n
    with torch.enable_grad():
        for step in range(steps):
            if at + size > n:  # a new pass over the tokens, in a new order (slices, not gathers, per step)
                order = torch.randperm(n, generator=gen)
                z, target, at = z[:, :, order], target[:, :, order], 0
            pred = forward(z[:, :, at : at + size], w1, b1, w2, b2)
            loss = (pred - target[:, :, at : at + size]).pow(2).mean()
            at += size
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
            if progress is not None:
                progress(step + 1)
    w1, b1, w2, b2 = (p.detach() for p in params)
    return Predictor(w1, b1, w2 * y_std[..., None], b2 * y_std + y_mean, mean, std)


def fit_layers(xs: list[torch.Tensor], ys: list[torch.Tensor], hidden: int, **options: Any) -> Predictor:
    """`fit` for layers that hold different numbers of tokens (a sliding window's layers hold
    fewer): xs per layer (h, N_l, F), ys per layer (h, N_l); layers with equal N_l fit as one batch."""
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.shape[1], []).append(i)
    parts: dict[int, Predictor] = {}
    for layers in groups.values():
        fitted = fit(torch.stack([xs[i] for i in layers]), torch.stack([ys[i] for i in layers]), hidden, **options)
        for j, i in enumerate(layers):
            parts[i] = Predictor(*(t[j : j + 1] for t in fitted.tensors().values()))
    order = [parts[i] for i in range(len(xs))]
    return Predictor(*(torch.cat(ts) for ts in zip(*(p.tensors().values() for p in order), strict=True)))


def kept_overlap(predicted: torch.Tensor, teacher: torch.Tensor, fraction: float) -> float:
    """Of the tokens the teacher keeps at `fraction` (its top share per head), the share the
    prediction keeps too, averaged over heads: predicted, teacher (..., N)."""
    k = max(1, round(fraction * teacher.shape[-1]))
    mine = torch.zeros_like(teacher, dtype=torch.bool).scatter(-1, predicted.topk(k, dim=-1).indices, True)
    theirs = torch.zeros_like(teacher, dtype=torch.bool).scatter(-1, teacher.topk(k, dim=-1).indices, True)
    return float((mine & theirs).sum(-1).float().mean() / k)
