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

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from kvstack.errors import UserError
from kvstack.methods.learned.features import features as token_features
from kvstack.methods.learned.features import kernel_scores, linear_scores
from kvstack.models.rope import rotate

if TYPE_CHECKING:
    from kvstack.methods.learned.sink_attention import SinkAttention

FORMAT = "1"  # bump when a file written now could not be read back by the code that reads it
SHIPPED = Path(__file__).resolve().parent / "shipped"  # predictors trained for the registered models
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
        write(self.tensors(), self.meta, path)


def write(tensors: dict[str, torch.Tensor], meta: dict[str, str], path: Path, names: tuple[str, ...] = NAMES) -> None:
    """A predictor file at `path`: `tensors` (float32), `meta` with the format and their hash, written
    atomically (a partial file is never left at `path`)."""
    tensors = {name: t.detach().float().contiguous().cpu() for name, t in tensors.items()}
    meta = {**meta, "format": FORMAT, "sha256": digest(tensors, names)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    from safetensors.torch import save_file

    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def before_rope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """keys (b, h, t, d) at `positions` turned back to before RoPE (float32); as they are without it."""
    return rotate(keys.float(), -positions.float(), inv_freq) if inv_freq is not None else keys


def forward(z: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """(..., h, t) scores from standardised features z (..., h, t, F) for one layer's heads:
    w1 (h, F, k), b1 (h, k), w2 (h, k), b2 (h); linear when k = 0 (w1 (h, F, 1))."""
    if w2.shape[-1] == 0:
        return (z @ w1).squeeze(-1) + b2[..., :, None]
    hidden = F.gelu(z @ w1 + b1[..., :, None, :])
    return (hidden * w2[..., :, None, :]).sum(-1) + b2[..., :, None]


def digest(tensors: dict[str, torch.Tensor], names: tuple[str, ...] = NAMES) -> str:
    """SHA-256 of the tensors' bytes, in `names` order."""
    h = hashlib.sha256()
    for name in names:
        h.update(tensors[name].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def predictor_path(model_key: str, method: str) -> Path:
    """Where `kvstack train` writes a predictor: beside the model's calibrations
    (`calibrate.store.calibration_dir`, $KVSTACK_CALIBRATION overrides)."""
    from kvstack.calibrate.store import calibration_dir

    return calibration_dir() / f"{model_key}-{method}.safetensors"


def find(model_key: str, method: str, model_name: str = "MODEL") -> Path:
    """The predictor file for this model: one trained here first, else the one shipped with kvstack."""
    for folder in (predictor_path(model_key, method).parent, SHIPPED):
        path = folder / f"{model_key}-{method}.safetensors"
        if path.exists():
            return path
    raise UserError(
        f"{method} has no predictor for this model ({model_key}): train one with "
        f"`kvstack train {method} --model {model_name}` (minutes on a CPU)"
    )


def load(path: Path, model_key: str, method: str, model_name: str = "MODEL") -> Predictor | SinkAttention:
    """The predictor in `path` (an MLP, or Fast KVzip's sink attention where its header says
    "network": "sink"), refused in one line when it is not a predictor for this model and this
    format, or its tensors do not match their recorded hash."""
    from kvstack.methods.learned.sink_attention import NETWORK, SinkAttention

    rebuild = f"rebuild it with `kvstack train {method} --model {model_name}`"
    if not path.exists():
        raise UserError(f"{path}: no such predictor file: {rebuild}")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            kind = SinkAttention if meta.get("network") == NETWORK else Predictor
            tensors = {name: f.get_tensor(name) for name in kind.names}
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise UserError(f"{path} is not a readable predictor file ({type(e).__name__}): {rebuild}") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} is predictor format {meta.get('format')!r}, this kvstack reads {FORMAT!r}: {rebuild}")
    if meta.get("method") != method:
        raise UserError(f"{path} is a {meta.get('method')!r} predictor, not {method!r}: {rebuild}")
    if meta.get("model_key") != model_key:
        raise UserError(f"{path} was trained for model {meta.get('model_key')}, not this one ({model_key}): {rebuild}")
    if meta.get("sha256") != digest(tensors, kind.names):
        raise UserError(f"{path} is damaged (its tensors do not match their hash): {rebuild}")
    return kind(**tensors, meta=meta)
