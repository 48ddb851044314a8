"""A learned per-head score predictor: one small network per (layer, KV head), saved as one file.

Input per token: its key before RoPE and its value, side by side (2d), four numbers on how it
stands among its head's tokens and, in the "local" set, how it stands among its neighbours, its
age and its squared coordinates (`features`), standardised with the training data's mean and
spread; output: a score, higher = keep. The network is linear (`hidden` 0) or a 2-layer MLP
with GELU, all heads of a layer run as one batched product.
Files are safetensors with a JSON-free string header: the format, the model they were trained
for (`calibrate.store.model_key`), the teacher and how it was trained; a file for another model
or another format is refused in one line that names the command that rebuilds it, and the
tensors' SHA-256 is checked on load (a flipped byte is refused too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from kvstack.methods.learned.features import before_rope, kernel_scores, linear_scores
from kvstack.methods.learned.features import features as token_features
from kvstack.methods.learned.files import read, write

if TYPE_CHECKING:
    from kvstack.methods.learned.sink_attention import SinkAttention

NAMES = ("w1", "b1", "w2", "b2", "mean", "std")


@dataclass
class Predictor:
    """Weights of every head's network, stacked (L layers, h KV heads, F = 2d + 4 features, k hidden):
    w1 (L, h, F, k), b1 (L, h, k), w2 (L, h, k), b2 (L, h); with k = 0 the network is linear and
    w1 (L, h, F, 1) holds its weights. mean, std (L, h, F) standardise the features."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)
    _on: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)
    names = NAMES  # the tensors a file of this network holds

    @property
    def features(self) -> str:
        """Which `features` it reads (FEATURE_SETS)."""
        return self.meta.get("features", "kv")

    @property
    def linear(self) -> bool:
        return self.w2.shape[-1] == 0

    @property
    def heads(self) -> int:
        """Outputs per layer: `o` per KV head, in blocks of h."""
        return self.w1.shape[1]

    @property
    def width(self) -> int:
        """F, the features it reads."""
        return self.w1.shape[2]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in NAMES}

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The weights on `device` (moved once, not at every call); a linear network's standardisation
        folded into its weights: "weight" (L, h, F, 1), "bias" (L, h)."""
        p = self._on.get(device)
        if p is None:
            p = self._on[device] = {name: t.float().to(device) for name, t in self.tensors().items()}
            if self.linear:
                w = p["w1"][..., 0] / p["std"]  # (L, h, F)
                p["weight"], p["bias"] = w[..., None], p["b2"] - (p["mean"] * w).sum(-1)
        return p

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """(b, h, t) scores of layer `layer` from features x (b, h, t, F)."""
        p = self.on(x.device)
        if self.linear:
            return (x.float() @ p["weight"][layer]).squeeze(-1) + p["bias"][layer][:, None]
        z = (x.float() - p["mean"][layer][:, None]) / p["std"][layer][:, None]
        return forward(z, p["w1"][layer], p["b1"][layer], p["w2"][layer], p["b2"][layer])

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
        """(b, o*h, t) the outputs of layer `layer` for held tokens: keys after RoPE (before it
        when `inv_freq` is None) and values (b, h, t, d), `valid`, `ages` and `positions`
        (b, h, t); o = the predictor's heads over h (its outputs per KV head, in blocks of h). A
        linear network is summed feature by feature, never writing the (t, F) matrix (the C
        kernel, else `linear_scores`): the scoring a compression pays for; an MLP reads the matrix."""
        h = keys.shape[1]
        o = self.w1.shape[1] // h
        if self.linear:
            p = self.on(keys.device)
            weight = p["weight"][layer][..., 0].reshape(o, h, -1).permute(1, 2, 0)  # (h, F, o)
            out = kernel_scores(keys, values, valid, ages, self.features, weight, positions, inv_freq)
            if out is None:
                out = linear_scores(before_rope(keys, positions, inv_freq), values, valid, ages, self.features, weight)
            return out.permute(0, 3, 1, 2).flatten(1, 2) + p["bias"][layer][:, None]  # (b, h, t, o) -> (b, o*h, t)
        x = token_features(before_rope(keys, positions, inv_freq), values, valid, ages, self.features)
        return self.predict(layer, torch.cat([x] * o, dim=1) if o > 1 else x)

    def save(self, path: Path) -> None:
        """Write the weights and the header (atomically: a partial file is never left at `path`)."""
        write(self.tensors(), self.meta, path, NAMES)


def forward(z: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """(..., h, t) scores from standardised features z (..., h, t, F) for one layer's heads:
    w1 (h, F, k), b1 (h, k), w2 (h, k), b2 (h); linear when k = 0 (w1 (h, F, 1))."""
    if w2.shape[-1] == 0:
        return (z @ w1).squeeze(-1) + b2[..., :, None]
    hidden = F.gelu(z @ w1 + b1[..., :, None, :])
    return (hidden * w2[..., :, None, :]).sum(-1) + b2[..., :, None]


def load(path: Path, model_key: str, method: str, model_name: str = "MODEL") -> Predictor | SinkAttention:
    """The predictor in `path` (an MLP, or Fast KVzip's sink attention where its header says
    "network": "sink"), checked as `files.read` checks it."""
    from kvstack.methods.learned.sink_attention import NETWORK, SinkAttention

    kinds: dict[str, type[Predictor] | type[SinkAttention]] = {"": Predictor, NETWORK: SinkAttention}
    network, tensors, meta = read(path, model_key, method, {k: kind.names for k, kind in kinds.items()}, model_name)
    return kinds[network](**tensors, meta=meta)
