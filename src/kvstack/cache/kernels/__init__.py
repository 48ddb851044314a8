"""Native kernels: small C sources shipped with kvstack (with common.h, what they share), built
once per machine with the system's C compiler into kvstack's cache folder and loaded with ctypes
(no torch headers: a build takes about a second). Where there is no compiler, or
`KVSTACK_KERNELS=0`, `library` returns None and callers stay on torch."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvstack.paths import cache_dir

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)  # after the source: the softmax tail calls expf
log = logging.getLogger(__name__)


def enabled() -> bool:
    """False when `KVSTACK_KERNELS=0` asks for torch alone (to compare, or to rule the kernels out)."""
    return os.environ.get("KVSTACK_KERNELS", "1") != "0"


def _machine() -> str:
    """What a `-march=native` build depends on: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    return platform.machine() + flags


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("kvstack: no C compiler found; quantized caches decode through torch (slower)")
        return None
    text = b"".join(f.read_bytes() for f in (source, *sorted(source.parent.glob("*.h"))))  # the headers it includes
    key = hashlib.sha256(text + " ".join(FLAGS + LIBS).encode() + _machine().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{key}.so"
    try:  # a cache folder that cannot be written, a failed build, a library that does not load: torch
        if not target.exists():
            _build(compiler, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("kvstack: the %s kernel could not be built with %s; using torch:\n%s", name, compiler, err)
        return None


def _build(compiler: str, source: Path, target: Path) -> None:
    """Compile `source` into `target`, replacing older builds of it; raises OSError on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        run = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), *LIBS], capture_output=True, text=True)
        if run.returncode:
            raise OSError(run.stderr or f"exit status {run.returncode}")
        os.replace(built, target)  # atomic: processes building at once each install a whole file
    for stale in target.parent.glob(f"{target.name.split('-')[0]}-*.so"):  # older sources, other machines
        if stale != target:
            stale.unlink(missing_ok=True)


def library(name: str) -> ctypes.CDLL | None:
    """The kernel library `name` (kernels/NAME.c), built on first use; None where it cannot be."""
    return _load(name) if enabled() else None


def pointer(x: torch.Tensor) -> ctypes.c_void_p:
    """The address of x's first element, as a kernel reads it (x must stay alive for the call)."""
    return ctypes.c_void_p(x.data_ptr())


def stack_heads(xs: list[torch.Tensor]) -> torch.Tensor:
    """h heads' (b, ...) tensors as (b*h, ...), sequence-major (row j*h + i: sequence j, head i)."""
    return xs[0] if len(xs) == 1 else torch.stack(xs, dim=1).flatten(0, 1)
