"""NVIDIA's kvpress as a rival: its own presses, in its own environment, on kvstack's samples.

(Not named kvpress.py: the worker script beside it must import the real kvpress.)

kvpress pins transformers and patches attention at import, so it runs in a separate virtual
environment (`make rivals` builds `.venv-kvpress`; `KVSTACK_KVPRESS_PYTHON` points elsewhere)
and talks to kvstack over JSON lines (`kvpress_worker.py`). Budgets map to kvpress's
`compression_ratio = 1 - budget` (share of tokens removed).

`kvpress:keydiff+quanto2` runs the press over transformers' `QuantizedCache` (optimum-quanto,
2 or 4 bits, its defaults: groups of 64, a 128-token full-precision residual): kvpress's own
way to stack eviction and quantization. A quantized token costs q = (bits + 2 * w / 64) / w of a
full one (w: the model dtype's bits; a scale and a shift per group, in that dtype), so the press
keeps about budget / q of the context (2 bits in bf16: q = 0.156).

The rival's model runs in kvstack's dtype, so a fraction of the full cache is the same bytes on
both sides (kvstack loads float32 on CPUs without bf16: there a 4-bit code is an eighth of a full
value, not a quarter). As in kvstack, the budget is the compressed context's: the question's
tokens, appended after it, are held whole beside it and not counted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from kvstack.bench.rivals.kvpress_worker import PRESSES
from kvstack.errors import UserError

WORKER = Path(__file__).with_name("kvpress_worker.py")
# kvstack method -> the kvpress press that implements the same paper
COUNTERPART = {
    "snapkv": "snapkv",
    "knorm": "knorm",
    "streaming": "streaming_llm",
    "tova": "tova",
    "h2o": "observed_attention",
    "keydiff": "keydiff",
    "lagkv": "lagkv",
    "pyramid": "pyramidkv",
    "adakv": "adakv",
    "kvzip": "kvzip",
    "d2o": "merging_observed_attention",  # kvpress's merge-on-evict wrapper over H2O's scores
}


QUANTO = re.compile(r"^(?P<press>[a-z_]+)\+quanto(?P<bits>[24])$")
QUANTO_GROUP, QUANTO_RESIDUAL = 64, 128


def quanto_ratio(bits: int, dtype_bits: int = 16) -> float:
    """Bytes of a value once quanto stores it, over its bytes in the model's dtype (`dtype_bits`
    wide): its code plus its share of the group's scale and shift, both in that dtype."""
    return (bits + 2 * dtype_bits / QUANTO_GROUP) / dtype_bits


def request_for(press: str, budget: float, dtype: str = "bfloat16") -> dict[str, Any]:
    """The worker's press, compression ratio (share of the context's tokens removed), dtype and
    (for `P+quantoN`) the quantized cache's settings, at a byte budget."""
    import torch

    quanto = QUANTO.match(press)
    if quanto is None:
        return {"press": press, "ratio": 1.0 - budget, "dtype": dtype}
    bits = int(quanto["bits"])
    keep = min(1.0, budget / quanto_ratio(bits, getattr(torch, dtype).itemsize * 8))
    settings = {"nbits": bits, "group": QUANTO_GROUP, "residual": QUANTO_RESIDUAL}
    return {"press": quanto["press"], "ratio": 1.0 - keep, "dtype": dtype, "quantized": settings}


def presses_for(rival: str, methods: tuple[str, ...]) -> list[str]:
    """`kvpress` -> the presses matching the sweep's methods; `kvpress:all` -> every press; `kvpress:P` -> P."""
    _, _, press = rival.partition(":")
    if press == "all":
        return list(PRESSES)
    if press:
        base = QUANTO.match(press)
        if (base["press"] if base else press) not in PRESSES:
            from kvstack.errors import unknown_name

            raise unknown_name("kvpress press", press, [*PRESSES, *(f"{p}+quanto2" for p in PRESSES)])
        return [press]
    names = [m.split("(")[0].split("+")[0].strip() for m in methods]
    return [COUNTERPART[n] for n in dict.fromkeys(names) if n in COUNTERPART]


def kvpress_python() -> Path:
    """The interpreter of kvpress's environment, or a one-line error naming the fix."""
    path = Path(os.environ.get("KVSTACK_KVPRESS_PYTHON", ".venv-kvpress/bin/python"))
    if not path.exists():
        raise UserError(
            f"kvpress runs in its own environment and {path} is missing: run `make rivals` "
            "(or set KVSTACK_KVPRESS_PYTHON to a python with kvpress==0.5.5)"
        )
    return path


class KvpressRival:
    """A kvpress worker process, started on first use, answering one request at a time."""

    presses = tuple(PRESSES)

    def __init__(self, python: Path | None = None) -> None:
        self.python = python or kvpress_python()
        self.proc: subprocess.Popen[str] | None = None

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request (see the worker's docstring), return its result."""
        if self.proc is None:
            self.proc = subprocess.Popen(
                [str(self.python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the kvpress worker ({self.python}) exited; run it by hand to see why")
        result = json.loads(line)
        if "error" in result:
            raise RuntimeError(f"kvpress {request['press']}: {result['error']}")
        return result

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
