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
from kvstack.methods.learned.sink_attention import RANK, SINKS, SinkAttention, log_keep

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

    def squared_error(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (forward(z, w1, b1, w2, b2) - target).pow(2).mean()

    minimise([w1, b1, w2, b2], [z, target], squared_error, steps, batch, lr, gen, progress)
    w1, b1, w2, b2 = (p.detach() for p in (w1, b1, w2, b2))
    return Predictor(w1, b1, w2 * y_std[..., None], b2 * y_std + y_mean, mean, std)


def minimise(
    params: list[torch.Tensor],
    data: list[torch.Tensor],
    loss: Callable[..., torch.Tensor],
    steps: int,
    batch: int,
    lr: float,
    gen: torch.Generator,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Adam with a cosine schedule on `params`, in place: `steps` mini-batches of `batch` tokens
    of `data` (tensors (L, h, N, ...), sliced alike along N), `loss(*slices)` each; every pass
    over the tokens in a new order (slices per step, not gathers). `progress(k)` after k steps."""
    optimiser = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, steps)
    n = data[0].shape[2]
    size, at = min(batch, n), n
    with torch.enable_grad():
        for step in range(steps):
            if at + size > n:
                order = torch.randperm(n, generator=gen)
                data, at = [d[:, :, order] for d in data], 0
            value = loss(*(d[:, :, at : at + size] for d in data))
            at += size
            optimiser.zero_grad()
            value.backward()
            optimiser.step()
            schedule.step()
            if progress is not None:
                progress(step + 1)


def fit_sink_attention(
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int = RANK,
    groups: int = 1,
    sinks: int = SINKS,
    steps: int = 400,
    batch: int = 1024,
    lr: float = 1e-2,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> SinkAttention:
    """Fast KVzip's gates (`SinkAttention`) for L layers fitted to log scores y (L, h, N) from
    inputs x (L, h, N, F), `groups` queries per KV head (the model's query heads per KV head):
    binary cross-entropy between the gate p and exp(y) (KVzip's score, in [0, 1]), every layer
    and head at once. The paper's initialisation: sink keys and biases zero, projections uniform
    in +-1/sqrt(F)."""
    big_l, h, _, f = x.shape
    gen = torch.Generator().manual_seed(seed)

    def uniform(*shape: int) -> torch.Tensor:
        return ((torch.rand(*shape, generator=gen) * 2 - 1) / f**0.5).requires_grad_()

    p = {
        "wq": uniform(big_l, h, f, groups * rank),
        "bq": uniform(big_l, h, groups * rank),
        "wk": uniform(big_l, h, f, rank),
        "q_scale": torch.ones(big_l, h, rank, requires_grad=True),
        "k_scale": torch.ones(big_l, h, rank, requires_grad=True),
        "sinks": torch.zeros(big_l, h, sinks, rank, requires_grad=True),
        "bias": torch.zeros(big_l, h, groups, requires_grad=True),
    }

    def cross_entropy(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        keep, drop = log_keep(p, x)
        return -(target * keep + (1 - target) * drop).mean()

    minimise(list(p.values()), [x.float(), y.float().exp().clamp(0, 1)], cross_entropy, steps, batch, lr, gen, progress)
    return SinkAttention(**{name: t.detach() for name, t in p.items()})


def fit_layers(
    xs: list[torch.Tensor], ys: list[torch.Tensor], hidden: int, fitter: Callable[..., Any] = fit, **options: Any
) -> Any:
    """`fitter` (`fit`, or `sink_attention.fit`) for layers that hold different numbers of tokens
    (a sliding window's layers hold fewer): xs per layer (h, N_l, F), ys per layer (h, N_l);
    layers with equal N_l fit as one batch. `hidden` is the MLP's width (0: linear) or, for the
    sink attention, its rank."""
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.shape[1], []).append(i)
    parts: dict[int, Any] = {}
    for layers in groups.values():
        fitted = fitter(torch.stack([xs[i] for i in layers]), torch.stack([ys[i] for i in layers]), hidden, **options)
        for j, i in enumerate(layers):
            parts[i] = {name: t[j : j + 1] for name, t in fitted.tensors().items()}
    kind = type(fitted)
    return kind(**{name: torch.cat([parts[i][name] for i in range(len(xs))]) for name in kind.names})


def kept_overlap(predicted: torch.Tensor, teacher: torch.Tensor, fraction: float) -> float:
    """Of the tokens the teacher keeps at `fraction` (its top share per head), the share the
    prediction keeps too, averaged over heads: predicted, teacher (..., N)."""
    k = max(1, round(fraction * teacher.shape[-1]))
    mine = torch.zeros_like(teacher, dtype=torch.bool).scatter(-1, predicted.topk(k, dim=-1).indices, True)
    theirs = torch.zeros_like(teacher, dtype=torch.bool).scatter(-1, teacher.topk(k, dim=-1).indices, True)
    return float((mine & theirs).sum(-1).float().mean() / k)
