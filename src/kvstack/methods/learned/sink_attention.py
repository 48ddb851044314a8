"""Low-rank sink attention: Fast KVzip's gate network (#44, arXiv 2601.17668), one per layer.

Per KV head, a token's inputs x (F) give it a low-rank key k = RMS(x Wk) and one low-rank query
per query head of its group, q_g = RMS(x Wq_g + bq_g) (r wide, each RMS-normed with a learned
scale). The token's own key then competes, for its own queries, with `s` learned sink keys:

    p = mean_g  exp(k.q_g / sqrt(r) + b_g) / (exp(k.q_g / sqrt(r) + b_g) + sum_j exp(c_j.q_g / sqrt(r)))

the share of attention the token would keep against sinks that stand for "the rest of the
context". p lies in (0, 1) like KVzip's score (the most attention any re-reading query gives the
token) and is fitted to it by binary cross-entropy (`fit`). The token alone is read, so its gate
is fixed once written. Saved as a safetensors file beside the MLP predictors, with the same
header, hash check and one-line refusals (`files.read` checks either, `predictor.load` builds either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from kvstack.methods.learned.features import before_rope
from kvstack.methods.learned.features import features as token_features
from kvstack.methods.learned.files import write

NAMES = ("wq", "bq", "wk", "q_scale", "k_scale", "sinks", "bias")
NETWORK = "sink"  # the header's "network" entry that names this kind of file
RANK, SINKS = 16, 16  # the paper's gate width and sink keys


@dataclass
class SinkAttention:
    """Every layer's gates, stacked (L layers, h KV heads, F features, g query heads per KV head,
    r rank, s sinks): wq (L, h, F, g*r), bq (L, h, g*r), wk (L, h, F, r), q_scale and k_scale
    (L, h, r) the RMS norms' scales, sinks (L, h, s, r) the learned sink keys, bias (L, h, g)."""

    wq: torch.Tensor
    bq: torch.Tensor
    wk: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    sinks: torch.Tensor
    bias: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)
    names = NAMES
    linear = False  # an MLP-like network: it reads the feature matrix

    @property
    def heads(self) -> int:
        """Outputs per layer: one per KV head."""
        return self.wq.shape[1]

    @property
    def width(self) -> int:
        """F, the features it reads."""
        return self.wk.shape[2]

    @property
    def features(self) -> str:
        return self.meta.get("features", "gate")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in NAMES}

    def log_keep(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p, log (1 - p)), each (b, h, t): the gate of layer `layer` for inputs x (b, h, t, F)."""
        return log_keep({name: t[layer] for name, t in self.tensors().items()}, x.float())

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """(b, h, t) log p, KVzip's score in its own units (log), from inputs x (b, h, t, F) (log
        (1 - p), which only the fit needs, is not computed)."""
        return mean_log(F.logsigmoid(logits({name: t[layer] for name, t in self.tensors().items()}, x.float())))

    def score(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        ages: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor | None,
    ) -> torch.Tensor:
        """(b, h, t) log p for held tokens: keys after RoPE at `positions` (before it when
        `inv_freq` is None) and values (b, h, t, d); `valid` and `ages` are not read by the
        "gate" set the gates are trained on."""
        x = token_features(before_rope(keys, positions, inv_freq), values, valid, ages, self.features)
        return self.predict(layer, x)

    def save(self, path: Path) -> None:
        write(self.tensors(), {**self.meta, "network": NETWORK}, path, NAMES)


def rms(x: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., r) over its root mean square, times `scale` (r,) (RMSNorm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def logits(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """(..., h, t, g) for one layer's gates `p` (NAMES, without the layer dim) and inputs x
    (..., h, t, F): each of the g queries' logit for the token's own key less its logit for the
    sinks (log-sum-exp over them); the token keeps sigmoid of it against that query."""
    r, g = p["wk"].shape[-1], p["bias"].shape[-1]
    q = rms((x @ p["wq"] + p["bq"][..., None, :]).unflatten(-1, (g, r)), p["q_scale"][..., None, None, :])
    k = rms(x @ p["wk"], p["k_scale"][..., None, :])  # (..., h, t, r)
    own = (q * k[..., None, :]).sum(-1) / math.sqrt(r) + p["bias"][..., None, :]  # (..., h, t, g)
    sinks = q.flatten(-3, -2) @ p["sinks"].transpose(-1, -2)  # (..., h, t*g, s): one product per head
    against = torch.logsumexp(sinks.unflatten(-2, q.shape[-3:-1]) / math.sqrt(r), -1)  # (..., h, t, g)
    return own - against


def mean_log(log_p: torch.Tensor) -> torch.Tensor:
    """(..., h, t) the log of the mean over the last dim (the g queries) of probabilities given as logs."""
    return torch.logsumexp(log_p, -1) - math.log(log_p.shape[-1])


def log_keep(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log (1 - p)) (..., h, t) for one layer's gates `p` and inputs x (..., h, t, F): for
    each of the g queries a sigmoid of `logits`, averaged over the queries as probabilities."""
    z = logits(p, x)
    return mean_log(F.logsigmoid(z)), mean_log(F.logsigmoid(-z))
