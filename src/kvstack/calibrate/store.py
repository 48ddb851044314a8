"""Where head calibrations live: memoised in this process and saved on disk, keyed by the model.

A calibration is a small table measured once per model (for example (L, h_kv) head scores).
The key names the model by its type and a hash of its query projections, so two random tiny
models with different seeds get different tables while the same checkpoint loaded twice, from
another folder or in another dtype, reuses the saved one. Files go to
`<cache>/calibration/<key>-<kind>.pt`, `<cache>` being kvstack's cache directory
($KVSTACK_CACHE, else the user cache directory, e.g. ~/.cache/kvstack); $KVSTACK_CALIBRATION
overrides the folder (the tests keep theirs apart).

Tables measured for the registered models ship with kvstack (`shipped/<key>-<kind>.safetensors`,
written by `kvstack calibrate --ship`), so a fresh machine plans at once: a table measured here
comes first, then a shipped one ($KVSTACK_SHIPPED=0 leaves them out), else the table is measured.
A shipped file is checked (format, model, kind, SHA-256 of its bytes) and refused in one line
naming the command that measures it here.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstack.calibrate.prose import prompt_prefix
from kvstack.errors import UserError
from kvstack.models.config import text_config
from kvstack.paths import cache_dir
from kvstack.progress import LogLines

_MEMO: dict[tuple[str, str], torch.Tensor] = {}
SHIPPED = Path(__file__).resolve().parent / "shipped"  # tables measured for the registered models
FORMAT = "1"  # of a shipped file: bump when a file written now could not be read back
REBUILD = "measure it here with `kvstack calibrate --model MODEL` (or reinstall kvstack)"


def calibration_dir() -> Path:
    """The folder of saved calibrations: $KVSTACK_CALIBRATION, else `calibration/` in kvstack's
    cache directory ($KVSTACK_CACHE, like the converted models)."""
    own = os.environ.get("KVSTACK_CALIBRATION")
    return Path(own) if own else cache_dir() / "calibration"


def _probes(model: Any) -> list[torch.Tensor]:
    """Every query projection's weight (the first parameter when there is none)."""
    found = [p for name, p in model.named_parameters() if "q_proj" in name or "qkv" in name]
    return found or [next(model.parameters())]


# model -> (what its key was computed from: prefix, each probe's storage and version; the key):
# a cache is built per sweep cell and reads the key several times (10 ms each on SmolLM2)
_KEYS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def model_key(model: Any) -> str:
    """`<model type>-<12 hex>`: a hash of the model's shape and query weights. Not its name, folder
    or dtype: the first load of a packaged model (from its GGUF) and every later one (from the
    converted folder), in bfloat16 or float32, share their tables, as the same weights anywhere do.
    Memoised per model until a probed weight changes (its tensor version moves)."""
    probes, prefix = _probes(model), prompt_prefix(model)
    stamp = (tuple(prefix), *((p.data_ptr(), p._version, p.dtype) for p in probes))
    memo = _KEYS.get(model)
    if memo is not None and memo[0] == stamp:
        return memo[1]
    config = text_config(model.config)
    layers = config.num_hidden_layers
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    ident = f"{config.model_type}|{layers}|{kv}"
    if prefix:  # tables are measured on rows starting with it
        ident += f"|prefix{prefix}"
    ident += weights_ident(probes)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(config.model_type))[-48:]
    key = f"{slug}-{hashlib.sha1(ident.encode()).hexdigest()[:12]}"
    _KEYS[model] = (stamp, key)
    return key


def weights_ident(probes: list[torch.Tensor]) -> str:
    """The probed weights' shapes and sums, rounded to bfloat16 first: a float32 load (a CPU
    without bf16) names the same weights as a bf16 one."""
    ident = ""
    for probe in probes:
        w = probe.detach().to(torch.bfloat16).double()
        ident += f"|{tuple(w.shape)}|{float(w.sum()):.12e}|{float(w.abs().sum()):.12e}"
    return ident


def calibrated(model: Any, kind: str, compute: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """The table `kind` of this model: from memory, else from disk (measured here, else shipped with
    kvstack), else `compute(model)` (then saved).

    The table comes back on the CPU as float32. A file measured here that cannot be read is
    measured again; a folder that cannot be written only loses the disk copy.
    """
    key = (model_key(model), kind)
    if key in _MEMO:
        return _MEMO[key]
    path = calibration_dir() / f"{key[0]}-{kind}.pt"
    table = _load(path)
    if table is None and os.environ.get("KVSTACK_SHIPPED", "1") != "0":
        table = shipped(*key)
    if table is None:
        table = compute(model).detach().float().cpu()
        _save(table, path)
    _MEMO[key] = table
    return table


def measured_on(model: Any, kind: str, compute: Callable[[Any], torch.Tensor], what: str) -> torch.Tensor:
    """`calibrated` for a stage that measures `what` on the model; a cache built from a bare config
    (nothing to measure) is refused in one line that says to build it from the model."""
    if not hasattr(model, "config"):
        raise UserError(f"{what}: build the KVCache from the model (KVCache(model, ...)), not from its config")
    return calibrated(model, kind, compute)


def shipped(key: str, kind: str, folder: Path | None = None) -> torch.Tensor | None:
    """The table `kind` shipped for the model `key`, or None when none ships; a file that is not
    the table it is named for (format, model, kind, bytes) is refused with a `UserError`."""
    path = (folder or SHIPPED) / f"{key}-{kind}.safetensors"
    if not path.exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta, table = dict(f.metadata() or {}), f.get_tensor("table")
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise UserError(f"{path} is not a readable calibration ({type(e).__name__}): {REBUILD}") from None
    for field, want in (("format", FORMAT), ("model_key", key), ("kind", kind)):
        if meta.get(field) != want:
            raise UserError(f"{path} has {field} {meta.get(field)!r}, kvstack reads {want!r}: {REBUILD}")
    if meta.get("sha256") != _digest(table):
        raise UserError(f"{path} is damaged (its table does not match its hash): {REBUILD}")
    return table.float()


def ship_tables(model: Any, folder: Path | None = None) -> list[Path]:
    """Write every table this process used for `model` (memoised) where kvstack ships them
    (`folder`, default the package's), each with its format, model, kind and SHA-256."""
    from safetensors.torch import save_file

    key, out = model_key(model), []
    for (owner, kind), table in sorted(_MEMO.items()):
        if owner != key:
            continue
        path = (folder or SHIPPED) / f"{key}-{kind}.safetensors"
        tensor = table.detach().float().contiguous()
        meta = {"format": FORMAT, "model_key": key, "kind": kind, "sha256": _digest(tensor)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.partial")
            save_file({"table": tensor}, str(tmp), metadata=meta)
            tmp.replace(path)
        except OSError as e:
            raise UserError(f"cannot write {path} ({e.strerror}): ship from a checkout you can write to") from None
        out.append(path)
    return out


@contextmanager
def without_shipped() -> Iterator[None]:
    """Inside, tables are read only where they were measured here (or measured now): what
    `kvstack calibrate` measures is the model's own, not a copy of the shipped tables."""
    before = os.environ.get("KVSTACK_SHIPPED")
    os.environ["KVSTACK_SHIPPED"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVSTACK_SHIPPED"]
        else:
            os.environ["KVSTACK_SHIPPED"] = before


def _digest(table: torch.Tensor) -> str:
    return hashlib.sha256(table.float().contiguous().numpy().tobytes()).hexdigest()


def forget() -> None:
    """Drop the in-process memo (the files stay): the next call reads the disk again."""
    _MEMO.clear()


def _load(path: Path) -> torch.Tensor | None:
    if not path.exists():
        return None
    try:
        table = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):
        return None
    return table if isinstance(table, torch.Tensor) else None


def _save(table: torch.Tensor, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(table)}.partial")
        torch.save(table, tmp)
        tmp.replace(path)
    except OSError:
        pass


class Ticker:
    """Counts calibration steps; a rich progress bar (on stderr) appears once `after` seconds passed,
    so quick calibrations (tiny models, memoised tables) print nothing. Where stderr is not a
    terminal (a log file, CI) a bar cannot redraw, so `LogLines` writes a plain line at each tenth
    of the work, and at least every `every` seconds: a 40-minute calibration is not 40 silent minutes."""

    def __init__(self, description: str, total: int, after: float = 3.0, every: float = 300.0) -> None:
        self.description, self.total, self.after = description, total, after
        self.done = 0
        self.started = time.monotonic()
        self._bar: Progress | None = None
        self._task: Any = None
        self._console = Console(file=sys.stderr)
        self._lines = LogLines(description, total, after, every)

    def __enter__(self) -> Ticker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        if not self._console.is_terminal:
            self._lines.update(self.done)
            return
        if self._bar is None and time.monotonic() - self.started > self.after:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        if self._bar is not None:
            self._bar.update(self._task, completed=min(self.done, self.total))
