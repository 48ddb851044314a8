"""`kvstack train`: fit a learned scorer's predictor for a model (minutes on a CPU for SmolLM2)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvstack.errors import UserError
from kvstack.terminal import DEFAULT, err, fail, out


def train(
    method: Annotated[str, typer.Argument(help="the learned scorer to train: kvzap, retention, wgkv, sinkgate")],
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    teacher: Annotated[
        str | None,
        typer.Option(help="whose scores to learn (kvzap, wgkv, sinkgate: kvzip or future; retention: decay)"),
    ] = None,
    texts: Annotated[int, typer.Option(help="State of the Union rows to train on")] = 16,
    held: Annotated[int, typer.Option(help="other rows the predictor is checked on")] = 2,
    tokens: Annotated[int, typer.Option(help="tokens per row")] = 1024,
    hidden: Annotated[
        int | None,
        typer.Option(help="MLP width per head, 0: linear, solved exactly (wgkv: 32, others 0); sinkgate: rank (16)"),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(help="training steps: mini-batches of 4096 tokens, 400 (sinkgate: of 1024, 1200)")
    ] = None,
    features: Annotated[
        str | None,
        typer.Option(
            help="what the predictor reads: local (neighbours, age, squares; kvzap's), kv (retention's) "
            "or gate (the token alone; wgkv's and sinkgate's)"
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--out", "-o", help="file to write (default: where the method finds it)")
    ] = None,
) -> None:
    """Score prose with the teacher (kept on disk: a stopped run resumes), fit one small network per
    layer and KV head, check it on held-out rows, save it where METHOD finds it for this model."""
    try:
        from kvstack.models import load
        from kvstack.training.train import TRAINABLE, train

        if method not in TRAINABLE:
            from kvstack.errors import unknown_name

            raise unknown_name("trainable method", method, list(TRAINABLE))
        with err.status(f"loading {model}"):
            lm = load(model)
        result = train(lm.model, method, teacher, texts, held, tokens, hidden, steps, output, features)
    except UserError as e:
        fail(str(e))
        return
    shares = ", ".join(f"{100 * v:.1f}% of the teacher's top {k.split('@')[1]}" for k, v in result.held_out.items())
    out.print(f"held-out rows: the predictor keeps {shares}", highlight=False)
    seconds = f"teacher scores and inputs {result.teacher_s:.1f} s, fit {result.fit_s:.1f} s"
    out.print(f"{seconds}; wrote {result.path}", highlight=False)
