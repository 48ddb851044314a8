"""`kvstack calibrate`: measure once the tables a stack needs for a model (auto's distortion curves
and validation, head allocators' scores, quantizers' ranges) and keep them, here or shipped."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from kvstack.errors import UserError
from kvstack.terminal import DEFAULT, err, fail, out


def calibrate(
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    method: Annotated[str, typer.Option(help="the stack whose tables are measured")] = "auto",
    ship: Annotated[bool, typer.Option(help="also write them into kvstack's package (shipped with it)")] = False,
) -> None:
    """Measure what METHOD needs for the model (auto: ~13 min for SmolLM2 on 2 cores) and save it, so
    `kvstack plan` and later runs start at once; tables shipped with kvstack are not read, and those
    measured here before are reused."""
    try:
        from kvstack.cache.cache import KVCache
        from kvstack.calibrate.store import calibration_dir, ship_tables, without_shipped
        from kvstack.models import load
        from kvstack.stack import Stack

        stack = Stack.parse(method)
        with err.status(f"loading {model}"):
            lm = load(model)
        started = time.perf_counter()
        with without_shipped():
            KVCache(lm.model, stack, 0.5)  # a cache's policy prepares every stage: what it measures is kept
        seconds = time.perf_counter() - started
        out.print(f"{stack.label} on {model}: tables ready in {seconds:.1f} s, in {calibration_dir()}", highlight=False)
        for path in ship_tables(lm.model) if ship else []:
            out.print(f"shipped {path}", highlight=False)
    except UserError as e:
        fail(str(e))
