"""`kvstack cache save|load|info`: compress a context once into a file, answer questions from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvstack.errors import UserError
from kvstack.terminal import DEFAULT, err, fail, out, parse_method, print_answer, read_context

cache_app = typer.Typer(
    no_args_is_help=True,
    help="Save a compressed context to a file once; load it to answer many questions.",
)
MiB = 2**20
CacheFile = Annotated[Path, typer.Argument(help="a cache file written by `kvstack cache save`")]
AsJson = Annotated[bool, typer.Option("--json", help="print one JSON object")]


@cache_app.command("save")
def save(
    context_file: Annotated[Path, typer.Option("--context-file", "-c", help="text file with the context")],
    output: Annotated[Path, typer.Option("--out", "-o", help="the cache file to write (e.g. report.kvc)")],
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    method: Annotated[str, typer.Option(help="method spec (query-agnostic: the question comes later)")] = "kvzip",
    budget: Annotated[
        str, typer.Option(help="fraction of full-cache bytes (0.25), tokens per head, or a size")
    ] = "0.25",
    prefill_chunk: Annotated[
        int | None, typer.Option(help="prefill in chunks of this many tokens, compressing between them")
    ] = None,
) -> None:
    """Compress a context before any question is seen and write the cache to a file."""
    try:
        stack, parsed = parse_method(method, budget, prefill_chunk)  # fail before loading anything
        context = read_context(context_file)
        from kvstack.api import compress, save_cache
        from kvstack.models import load

        with err.status(f"loading {model}"):
            lm = load(model)
        with err.status(f"compressing the context with {stack} at budget {parsed}"):
            cache = compress(lm, context, stack, parsed, prefill_chunk)
            header = save_cache(cache, output, lm, context)
        seconds = cache.compress_clock.seconds
    except UserError as e:
        fail(str(e))
        return
    out.print(
        f"saved {output}: kv cache {header['kv_bytes'] / MiB:.2f} MiB of {header['kv_bytes_full'] / MiB:.2f} MiB "
        f"full (ratio {header['kv_bytes'] / header['kv_bytes_full']:.3f}), {header['tokens'][0]} tokens, "
        f"{header['stack']} at {header['budget']}; compress {seconds:.2f}s",
        highlight=False,
    )


@cache_app.command("load")
def load_and_answer(
    file: CacheFile,
    question: Annotated[str, typer.Option("--question", "-q", help="question about the cached context")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="default: the model the file names")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 32,
    answer_prefix: Annotated[str, typer.Option(help="text the answer starts with")] = "",
    as_json: AsJson = False,
) -> None:
    """Load a saved cache and answer a question from it (no prefill, no compression of the context)."""
    try:
        from kvstack.cache.saved import read_header

        header = read_header(file)
        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        from kvstack.api import answer_cached, load_cache
        from kvstack.models import load
        from kvstack.timing import now

        name = model or header["model"]
        with err.status(f"loading {name}"):
            lm = load(name)
        with err.status(f"answering from {file}"):
            started = now(lm.model.device)
            cache = load_cache(lm, file)
            load_s = now(lm.model.device) - started
            result = answer_cached(lm, cache, [question], max_new_tokens, answer_prefix)
    except UserError as e:
        fail(str(e))
        return
    row = result.to_json()
    payload = {"answer": row.pop("answers")[0], "model": name, "file": str(file), "load_s": load_s, **row}
    summary = (
        f"kv cache {payload['kv_bytes'] / MiB:.2f} MiB of {payload['kv_bytes_full'] / MiB:.2f} MiB full "
        f"(ratio {payload['kv_ratio']:.3f}); loaded in {load_s:.2f}s, question {payload['prefill_s']:.2f}s, "
        f"decode {payload['decode_tokens_per_s']:.1f} tok/s"
    )
    print_answer(payload, as_json, summary)


@cache_app.command("info")
def info(
    file: CacheFile,
    as_json: AsJson = False,
) -> None:
    """What a cache file holds (model, stack, budget, tokens, bytes), read without loading a model."""
    try:
        from kvstack.cache.saved import read_header

        header = read_header(file)
    except UserError as e:
        fail(str(e))
        return
    if as_json:
        sys.stdout.write(json.dumps(header) + "\n")
        return
    out.print(_info_table(file, header))


def _info_table(file: Path, header: dict[str, Any]) -> Table:
    table = Table(title=str(file), show_header=False)
    full = header["kv_bytes_full"] or 1
    rows = [
        ("model", f"{header['model']} (weights {header['fingerprint']})"),
        ("method", header["stack"]),
        ("budget", header["budget"]),
        ("tokens", ", ".join(str(n) for n in header["tokens"])),
        (
            "kv bytes",
            f"{header['kv_bytes'] / MiB:.2f} MiB of {full / MiB:.2f} MiB full ({header['kv_bytes'] / full:.3f})",
        ),
        ("method state", f"{header['aux_bytes'] / MiB:.2f} MiB (observed queries, statistics)"),
        ("file", f"{header['file_bytes'] / MiB:.2f} MiB, format {header['format']}"),
        ("text sha256", header.get("text_sha256") or "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
