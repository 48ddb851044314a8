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

import torch
from torch.nn import functional as F

from kvstack.errors import UserError

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

    @property
    def features(self) -> str:
        """Which `features` it reads (FEATURE_SETS)."""
        return self.meta.get("features", "kv")

    @property
    def linear(self) -> bool:
        return self.w2.shape[-1] == 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in NAMES}

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """(b, h, t) scores of layer `layer` from features x (b, h, t, F)."""
        p = self._on.get(x.device)
        if p is None:  # moved to a device once, not at every call
            p = self._on[x.device] = {name: t.float().to(x.device) for name, t in self.tensors().items()}
            if self.linear:  # the standardisation folded into the weights: one product, no copy of x
                w = p["w1"][..., 0] / p["std"]  # (L, h, F)
                p["weight"], p["bias"] = w[..., None], p["b2"] - (p["mean"] * w).sum(-1)
        if self.linear:
            return (x.float() @ p["weight"][layer]).squeeze(-1) + p["bias"][layer][:, None]
        z = (x.float() - p["mean"][layer][:, None]) / p["std"][layer][:, None]
        return forward(z, p["w1"][layer], p["b1"][layer], p["w2"][layer], p["b2"][layer])

    def save(self, path: Path) -> None:
        """Write the weights and the header (atomically: a partial file is never left at `path`)."""
        tensors = {name: t.detach().float().contiguous().cpu() for name, t in self.tensors().items()}
        meta = {**self.meta, "format": FORMAT, "sha256": digest(tensors)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        from safetensors.torch import save_file

        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)


def forward(z: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """(..., h, t) scores from standardised features z (..., h, t, F) for one layer's heads:
    w1 (h, F, k), b1 (h, k), w2 (h, k), b2 (h); linear when k = 0 (w1 (h, F, 1))."""
    if w2.shape[-1] == 0:
        return (z @ w1).squeeze(-1) + b2[..., :, None]
    hidden = F.gelu(z @ w1 + b1[..., :, None, :])
    return (hidden * w2[..., :, None, :]).sum(-1) + b2[..., :, None]


FEATURE_SETS = ("kv", "local")  # what a predictor reads; files without the "features" entry read "kv"
WINDOW = 16  # the tokens before a token whose mean the "local" features compare it with


def features(
    pre_rope_keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None = None,
    ages: torch.Tensor | None = None,
    kind: str = "kv",
) -> torch.Tensor:
    """(..., t, F) a token's features, keys before RoPE and values (..., t, d), `valid` (..., t)
    (default all). "kv" (F = 2d + 4): the key and the value, then how the token stands among the
    head's tokens: the cosine of its key and of its value with their mean directions (KeyDiff's
    anchor), and the log of their norms over the mean norms. A token alone cannot say it is rare;
    these can. "local" (F = 4d + 11) adds how it stands among its neighbours (`neighbours`), the
    log of its age `ages` (..., t) (tokens from it to the next query, >= 1) and the squares of
    the key's and value's coordinates: on held-out prose they keep 65% of KVzip's kept set at
    1/8 against 57% ("kv")."""
    if kind not in FEATURE_SETS:
        raise UserError(f"unknown predictor features {kind!r}: this kvstack reads {', '.join(FEATURE_SETS)}")
    if kind == "local" and ages is None:
        raise ValueError("the local features need each token's age")
    k, v = pre_rope_keys.float(), values.float()
    d = k.shape[-1]
    mask = torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device) if valid is None else valid
    out = k.new_empty(*k.shape[:-1], 2 * d + 4 if kind == "kv" else 4 * d + 11)  # filled in place: no concatenation
    out[..., :d], out[..., d : 2 * d] = k, v
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    for i, x in enumerate((k, v)):
        norm = x.norm(dim=-1).clamp(min=1e-6)  # (..., t)
        anchor = ((x / norm[..., None]) * mask[..., None]).sum(-2, keepdim=True) / count[..., None]
        out[..., 2 * d + 2 * i] = cosine(x, anchor, norm, anchor.norm(dim=-1))
        out[..., 2 * d + 2 * i + 1] = (norm / ((norm * mask).sum(-1, keepdim=True) / count)).log()
        if kind == "local":
            out[..., 2 * d + 4 + 3 * i : 2 * d + 7 + 3 * i] = neighbours(x, mask, norm)
            out[..., 2 * d + 11 + i * d : 2 * d + 11 + (i + 1) * d] = x * x
    if kind == "local":
        out[..., 2 * d + 10] = ages.float().clamp(min=1).log()
    return out


def cosine(x: torch.Tensor, y: torch.Tensor, x_norm: torch.Tensor, y_norm: torch.Tensor) -> torch.Tensor:
    """(...) the cosine of x and y (..., d) with their norms (...) given (0 where either is 0)."""
    return (x * y).sum(-1) / (x_norm * y_norm).clamp(min=1e-8)


def neighbours(x: torch.Tensor, mask: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """(..., t, 3) how each token of x (..., t, d), of norms `norm` (..., t), differs from the held
    tokens just before it (`mask` (..., t) the real ones): the cosine with the previous token, the
    cosine with the mean of the WINDOW before it, and the log of the distance to that mean. A fact
    in prose is where the text changes."""
    real = x * mask[..., None]
    t = x.shape[-2]
    previous = torch.cat([real[..., :1, :], real[..., :-1, :]], dim=-2)
    previous_norm = torch.cat([norm[..., :1], norm[..., :-1]], dim=-1) * torch.cat([mask[..., :1], mask[..., :-1]], -1)
    sums = torch.cat([torch.zeros_like(real[..., :1, :]), real.cumsum(-2)], dim=-2)  # (..., t + 1, d): sums before
    counts = torch.cat([torch.zeros_like(mask[..., :1]), mask.cumsum(-1)], dim=-1).float()
    lag = min(WINDOW, t)  # the sums WINDOW tokens back: the first token's until then (slices, not gathers)
    back = torch.cat([sums[..., :1, :].expand(*sums.shape[:-2], lag, -1), sums[..., : t - lag, :]], dim=-2)
    back_counts = torch.cat([counts[..., :1].expand(*counts.shape[:-1], lag), counts[..., : t - lag]], dim=-1)
    mean = (sums[..., :t, :] - back) / (counts[..., :t] - back_counts).clamp(min=1)[..., None]
    mean_norm = mean.norm(dim=-1)
    distance = (x - mean).norm(dim=-1).clamp(min=1e-6).log()
    return torch.stack([cosine(x, previous, norm, previous_norm), cosine(x, mean, norm, mean_norm), distance], -1)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in NAMES order."""
    h = hashlib.sha256()
    for name in NAMES:
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


def load(path: Path, model_key: str, method: str, model_name: str = "MODEL") -> Predictor:
    """The predictor in `path`, refused in one line when it is not a predictor for this model and
    this format, or its tensors do not match their recorded hash."""
    rebuild = f"rebuild it with `kvstack train {method} --model {model_name}`"
    if not path.exists():
        raise UserError(f"{path}: no such predictor file: {rebuild}")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in NAMES}
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise UserError(f"{path} is not a readable predictor file ({type(e).__name__}): {rebuild}") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} is predictor format {meta.get('format')!r}, this kvstack reads {FORMAT!r}: {rebuild}")
    if meta.get("method") != method:
        raise UserError(f"{path} is a {meta.get('method')!r} predictor, not {method!r}: {rebuild}")
    if meta.get("model_key") != model_key:
        raise UserError(f"{path} was trained for model {meta.get('model_key')}, not this one ({model_key}): {rebuild}")
    if meta.get("sha256") != digest(tensors):
        raise UserError(f"{path} is damaged (its tensors do not match their hash): {rebuild}")
    return Predictor(**tensors, meta=meta)
