"""A compressed cache saved to one file and loaded back as a working cache (KVLink's and KVzip's
reuse: compress a document once, answer many requests from it).

The file is safetensors: every tensor storage the cache keeps alive (keys, values, packed codes,
group scales, slots, log-counts, statistics, shared tables) is stored once as raw bytes, and
each tensor is rebuilt as the same view of it (dtype, shape, stride, offset), so storage shared
between heads or layers stays shared and `nbytes()` reads the same bytes after loading. The
objects around the tensors (layers' state, codecs, `auto`'s plan) are JSON in the file's
metadata, written field by field: only kvstack's own dataclasses and codecs are rebuilt, by
name, from modules already loaded; nothing is unpickled. A SHA-256 over the JSON and the bytes
refuses a file changed after it was written; a fingerprint of the model refuses another model's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from kvstack.cache.encoded import Codec
from kvstack.cache.factory import make_cache
from kvstack.cache.heads import PerHead
from kvstack.errors import UserError

if TYPE_CHECKING:
    from kvstack.cache.cache import KVCache

FORMAT = 1  # bump when a file written now could not be read back by the code that reads it
MAGIC = "kvstack-cache"


# ---- the model a cache belongs to ---------------------------------------------------------------
def model_name(model: Any) -> str:
    config = getattr(model, "config", model)
    return str(getattr(model, "kvstack_name", None) or getattr(config, "_name_or_path", "") or type(model).__name__)


def fingerprint(model: Any) -> str:
    """Hex digest naming a model's weights and shapes: its configuration, every parameter's name,
    shape and dtype, and the first elements of every tensor (a cache is only valid on the weights
    that computed it; reading them all would cost a second per GB)."""
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        head = tensor.detach().reshape(-1)[:16].float().cpu()
        digest.update(head.numpy().tobytes())
    model._kvstack_fingerprint = digest.hexdigest()[:24]
    return model._kvstack_fingerprint


# ---- objects <-> JSON with tensors beside ----------------------------------------------------------
def _allowed(cls: type) -> bool:
    """Classes a file may name: kvstack's own dataclasses and codecs."""
    return cls.__module__.startswith("kvstack.") and (dataclasses.is_dataclass(cls) or issubclass(cls, Codec))


class _Writer:
    """Turns a graph of plain values, tensors and kvstack objects into JSON (every JSON object is a
    tagged node) and a list of storages; an object met twice is written once (identity kept)."""

    def __init__(self) -> None:
        self.storages: list[torch.Tensor] = []  # raw bytes (uint8, on the CPU), one per distinct storage
        self._storage_index: dict[tuple[str, int], int] = {}
        self._objects: dict[int, int] = {}
        self._alive: list[Any] = []  # keeps objects alive while their ids are memo keys

    def pack(self, x: Any, where: str = "cache") -> Any:
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, torch.Tensor):
            return {"T": self._tensor(x)}
        if isinstance(x, torch.dtype):
            return {"D": str(x).removeprefix("torch.")}
        if isinstance(x, PerHead):
            return {"H": self.pack(x.stacked) if x.stacked is not None else [self.pack(h) for h in x]}
        if isinstance(x, list):
            return [self.pack(v, where) for v in x]
        if isinstance(x, tuple):
            return {"U": [self.pack(v, where) for v in x]}
        if isinstance(x, set | frozenset):
            return {"S": sorted(self.pack(v, where) for v in x)}
        if isinstance(x, dict):
            return {"M": [[self.pack(k, where), self.pack(v, f"{where}.{k}")] for k, v in x.items()]}
        return self._object(x, where)

    def _object(self, x: Any, where: str) -> Any:
        cls = type(x)
        if not _allowed(cls):
            raise UserError(f"cannot save this cache: {where} holds a {cls.__module__}.{cls.__qualname__}")
        if id(x) in self._objects:
            return {"R": self._objects[id(x)]}
        self._objects[id(x)] = n = len(self._objects)
        self._alive.append(x)
        state = {}
        for name, value in vars(x).items():
            if callable(value) and not isinstance(value, Codec) and getattr(cls, name, None) is value:
                continue  # a class default (Where's lambdas): the class gives it back on load
            state[name] = self.pack(value, f"{where}.{name}")
        return {"O": f"{cls.__module__}:{cls.__qualname__}", "id": n, "state": state}

    def _tensor(self, t: torch.Tensor) -> list[Any]:
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in self._storage_index or storage.nbytes() == 0:
            self._storage_index[key] = len(self.storages)
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            self.storages.append(raw.detach().cpu().contiguous())
        index = self._storage_index[key]
        return [index, str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()), t.storage_offset()]


class _Reader:
    """The inverse of `_Writer`: tensors become views of the loaded storages on `device`."""

    def __init__(self, storages: list[torch.Tensor], device: torch.device | str) -> None:
        self.storages = [s.to(device) for s in storages]
        self._objects: dict[int, Any] = {}

    def unpack(self, x: Any) -> Any:
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, list):
            return [self.unpack(v) for v in x]
        tag = next(iter(x))
        if tag == "T":
            index, dtype, shape, stride, offset = x["T"]
            raw = self.storages[index]
            view = torch.empty(0, dtype=_dtype(dtype), device=raw.device)
            return view.set_(raw.untyped_storage(), offset, shape, stride)
        if tag == "D":
            return _dtype(x["D"])
        if tag == "H":
            inner = x["H"]
            return (
                PerHead([self.unpack(h) for h in inner])
                if isinstance(inner, list)
                else PerHead(stacked=self.unpack(inner))
            )
        if tag == "U":
            return tuple(self.unpack(v) for v in x["U"])
        if tag == "S":
            return frozenset(self.unpack(v) for v in x["S"])
        if tag == "M":
            return {self.unpack(k): self.unpack(v) for k, v in x["M"]}
        if tag == "R":
            return self._objects[x["R"]]
        if tag == "O":
            return self._object(x)
        raise ValueError(f"unknown node {tag!r}")

    def _object(self, x: dict[str, Any]) -> Any:
        module, _, name = x["O"].partition(":")
        cls = getattr(sys.modules.get(module), name, None) if module.startswith("kvstack.") else None
        if not isinstance(cls, type) or not _allowed(cls):
            raise ValueError(f"names a class this kvstack does not know ({x['O']})")
        obj = cls.__new__(cls)
        self._objects[x["id"]] = obj  # before its state: an object may be reached from inside it
        obj.__dict__.update({k: self.unpack(v) for k, v in x["state"].items()})
        return obj


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# ---- the file ------------------------------------------------------------------------------------
def _state(cache: KVCache, last_logits: torch.Tensor | None) -> dict[str, Any]:
    """Everything a cache needs to go on as it would have: each layer's storage and statistics,
    the sequences' padding and exempt ranges, and what its policy decided (codecs, allocators'
    weights, `auto`'s plan)."""
    shares = cache.policy.shares
    return {
        "seq": cache.seq,
        "layers": [dict(vars(layer)) for layer in cache.layers],
        "signals": cache.signals,
        "confidence": cache.confidence,
        "compressions": cache.compressions,
        "peak_nbytes": cache.peak_nbytes,
        "codecs": shares.codecs,
        "demote_codecs": shares.demote_codecs,
        "weights": shares.weights,
        "plan": shares.planner.plan if shares.planner is not None else None,
        "last_logits": last_logits,
    }


def _digest(state_json: str, storages: list[torch.Tensor]) -> str:
    digest = hashlib.sha256(state_json.encode())
    for raw in storages:
        digest.update(memoryview(raw.numpy()))  # the bytes in place, not a copy
    return digest.hexdigest()


def save(
    cache: KVCache, path: str | Path, text_sha256: str | None = None, last_logits: torch.Tensor | None = None
) -> dict[str, Any]:
    """Write `cache` to `path` (atomically: a reader never sees half a file); its header back.

    text_sha256: the hash of the text the cache holds (a prefix store's key); last_logits (b, vocab):
    the model's output after the last token, kept so a loaded cache can go on without a question."""
    if not cache.is_initialized:
        raise UserError("cannot save an empty cache: prefill a context first")
    source = cache.source
    if not hasattr(source, "state_dict"):
        raise UserError("cannot save a cache built from a config: build it from the model")
    writer = _Writer()
    state = json.dumps(writer.pack(_state(cache, last_logits)), separators=(",", ":"))
    first = cache.layers[0]
    header = {
        "magic": MAGIC,
        "format": FORMAT,
        "model": model_name(source),
        "fingerprint": fingerprint(source),
        "stack": cache.stack.label,
        "budget": str(cache.budget),
        "batch": first.batch,
        "tokens": cache.seq.real_counts(first.seen, first.batch).tolist(),
        "slots": first.seen,
        "kv_bytes": cache.nbytes(),
        "kv_bytes_full": cache.full_nbytes(),
        "aux_bytes": cache.aux_nbytes(),
        "text_sha256": text_sha256,
    }
    metadata = {
        "kvstack": json.dumps(header),
        "state": state,
        "sha256": _digest(json.dumps(header) + state, writer.storages),
    }
    blob = save_tensors({f"s{i}": raw for i, raw in enumerate(writer.storages)}, metadata=metadata)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    partial.write_bytes(blob)
    os.replace(partial, path)
    return header


def _metadata(blob: bytes, path: Path) -> dict[str, str]:
    """The safetensors metadata of a file's bytes (the format: 8 bytes little-endian header length,
    then the JSON header)."""
    try:
        (n,) = struct.unpack("<Q", blob[:8])
        if n > len(blob) - 8:
            raise ValueError("header runs past the end")
        metadata = json.loads(blob[8 : 8 + n]).get("__metadata__") or {}
    except (struct.error, ValueError, AttributeError) as e:
        raise UserError(f"{path} is not a kvstack cache file (or is truncated): {e}") from None
    if "kvstack" not in metadata:
        raise UserError(f"{path} is a safetensors file but not a kvstack cache: save one with `kvstack cache save`")
    return metadata


def read_header(path: str | Path) -> dict[str, Any]:
    """A saved cache's header (model, stack, budget, tokens, bytes) without loading its tensors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no cache file at {path}: save one with `kvstack cache save`")
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        blob = head + f.read(min(n, 100_000_000))
    header = _header(_metadata(blob, path), path)
    header["file_bytes"] = path.stat().st_size
    return header


def _header(metadata: dict[str, str], path: Path) -> dict[str, Any]:
    try:
        header = json.loads(metadata["kvstack"])
        fmt = int(header["format"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: its kvstack header is damaged ({e}): save the cache again") from None
    if header.get("magic") != MAGIC:
        raise UserError(f"{path}: its kvstack header is damaged (no {MAGIC!r} mark): save the cache again")
    if fmt > FORMAT:
        raise UserError(
            f"{path} was written in cache format {fmt}, newer than this kvstack reads ({FORMAT}): upgrade kvstack"
        )
    return header


def load(model: Any, path: str | Path) -> tuple[KVCache, torch.Tensor | None, dict[str, Any]]:
    """(cache, last logits or None, header) read from `path`, on `model`'s device: a working cache
    that answers exactly as the one saved (same tokens, same logits, same bytes)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no cache file at {path}: save one with `kvstack cache save`")
    blob = path.read_bytes()
    metadata = _metadata(blob, path)
    header = _header(metadata, path)
    try:
        tensors = load_tensors(blob)
    except Exception as e:  # safetensors raises its own error types for a cut or garbled body
        raise UserError(f"{path} is damaged or truncated ({type(e).__name__}): save the cache again") from None
    storages = (
        [tensors[f"s{i}"] for i in range(len(tensors))]
        if all(f"s{i}" in tensors for i in range(len(tensors)))
        else None
    )
    if storages is None or _digest(metadata["kvstack"] + metadata.get("state", ""), storages) != metadata.get("sha256"):
        raise UserError(
            f"{path} is damaged: its bytes do not match the checksum written with them; save the cache again"
        )
    mine = fingerprint(model)
    if header["fingerprint"] != mine:
        raise UserError(
            f"{path} holds a cache of model {header['model']!r}, not of {model_name(model)!r} (weights differ): "
            f"load it with the model it was saved from"
        )
    try:
        state = _Reader(storages, model.device).unpack(json.loads(metadata["state"]))
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise UserError(f"{path} cannot be read by this kvstack ({e}): save the cache again") from None
    cache = make_cache(model, header["stack"], header["budget"])
    _restore(cache, state)
    cache.last_logits = state["last_logits"]
    return cache, state["last_logits"], header


def _restore(cache: KVCache, state: dict[str, Any]) -> None:
    """Put a saved state into a cache freshly built for the same model, stack and budget."""
    cache.seq = state["seq"]
    for layer, saved in zip(cache.layers, state["layers"], strict=True):
        vars(layer).update(saved)
        layer.seq = cache.seq
    cache.signals, cache.confidence = state["signals"], state["confidence"]
    cache.compressions, cache.peak_nbytes = state["compressions"], state["peak_nbytes"]
    shares = cache.policy.shares
    shares.codecs, shares.demote_codecs, shares.weights = state["codecs"], state["demote_codecs"], state["weights"]
    if shares.planner is not None:
        shares.planner.plan = state["plan"]
    shares.forget()
