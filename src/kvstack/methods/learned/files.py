"""A learned scorer's file: where it lives (trained here, else shipped), written atomically with
its tensors' SHA-256, and read back checked: a file for another model, method or format, or a
damaged one, is refused in one line naming the command that rebuilds it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvstack.errors import UserError

FORMAT = "1"  # bump when a file written now could not be read back by the code that reads it
SHIPPED = Path(__file__).resolve().parent / "shipped"  # predictors trained for the registered models


def write(tensors: dict[str, torch.Tensor], meta: dict[str, str], path: Path, names: tuple[str, ...]) -> None:
    """A predictor file at `path`: `tensors` (float32), `meta` with the format and their hash, written
    atomically (a partial file is never left at `path`)."""
    tensors = {name: t.detach().float().contiguous().cpu() for name, t in tensors.items()}
    meta = {**meta, "format": FORMAT, "sha256": digest(tensors, names)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    from safetensors.torch import save_file

    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def digest(tensors: dict[str, torch.Tensor], names: tuple[str, ...]) -> str:
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


def read(
    path: Path, model_key: str, method: str, names: dict[str, tuple[str, ...]], model_name: str = "MODEL"
) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """(network, tensors, header) of the file at `path`: `names` maps each network a header's
    "network" entry may name ("" when it names none) to the tensors such a file holds. Refused in
    one line when it is not a file for this model, method and format, or its tensors do not match
    their recorded hash."""
    rebuild = f"rebuild it with `kvstack train {method} --model {model_name}`"
    if not path.exists():
        raise UserError(f"{path}: no such predictor file: {rebuild}")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            network = meta.get("network", "")
            tensors = {name: f.get_tensor(name) for name in names.get(network, ())}
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise UserError(f"{path} is not a readable predictor file ({type(e).__name__}): {rebuild}") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} is predictor format {meta.get('format')!r}, this kvstack reads {FORMAT!r}: {rebuild}")
    if meta.get("method") != method:
        raise UserError(f"{path} is a {meta.get('method')!r} predictor, not {method!r}: {rebuild}")
    if meta.get("model_key") != model_key:
        raise UserError(f"{path} was trained for model {meta.get('model_key')}, not this one ({model_key}): {rebuild}")
    if network not in names:
        raise UserError(f"{path} holds a {network!r} network this kvstack does not know: {rebuild}")
    if meta.get("sha256") != digest(tensors, names[network]):
        raise UserError(f"{path} is damaged (its tensors do not match their hash): {rebuild}")
    return network, tensors, meta
