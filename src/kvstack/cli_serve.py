"""`kvstack serve`: the OpenAI-compatible server, its KV memory capped in bytes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from kvstack.errors import UserError
from kvstack.terminal import DEFAULT, err, fail, parse_method


def serve(
    model: Annotated[str, typer.Option("--model", "-m", help="registered name, local folder or .gguf")] = DEFAULT,
    method: Annotated[str, typer.Option(help="default method spec (a request's kv_method overrides it)")] = "auto",
    budget: Annotated[str, typer.Option(help="default budget: fraction of full bytes, tokens per head, or size")] = (
        "0.125"
    ),
    kv_memory: Annotated[
        str, typer.Option("--kv-memory", help="KV bytes all running requests may hold together, e.g. 256MB")
    ] = "256MB",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="KVSTACK_API_KEY", help="require 'Authorization: Bearer KEY'")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="the most tokens one request may generate")] = 1024,
    max_waiting: Annotated[int, typer.Option(help="requests queued for memory before 503s")] = 64,
    store: Annotated[
        Path | None, typer.Option(help="prefix store folder for kv_context documents [default: the user cache]")
    ] = None,
    store_size: Annotated[str, typer.Option(help="disk the prefix store may use")] = "2GB",
    prefill_chunk: Annotated[
        int | None, typer.Option(help="prefill in chunks of this many tokens, compressing between them")
    ] = None,
) -> None:
    """Serve a model over OpenAI's completions and chat API, compressing every request's KV cache;
    requests run together while their measured KV bytes fit in --kv-memory."""
    try:
        from kvstack.cache.budget import Budget

        stack, parsed = parse_method(method, budget, prefill_chunk)
        memory = Budget.parse(kv_memory).nbytes
        if memory is None:
            raise UserError(f"--kv-memory {kv_memory!r}: give a size such as 256MB")
        if not 1 <= port <= 65535:
            raise UserError(f"--port {port}: give a port from 1 to 65535")
        if max_tokens < 1 or max_waiting < 0:
            raise UserError("--max-tokens must be at least 1 and --max-waiting at least 0")
        import uvicorn

        from kvstack.models import load
        from kvstack.paths import cache_dir
        from kvstack.reuse.store import PrefixStore
        from kvstack.serve.app import create_app
        from kvstack.serve.engine import Engine

        prefixes = PrefixStore(store or cache_dir() / "prefix-store", store_size)
        with err.status(f"loading {model}"):
            lm = load(model)
        engine = Engine(lm, stack, parsed, memory, prefixes, max_waiting, prefill_chunk)
    except ImportError as e:
        fail(f"{e.name} is not installed: pip install 'kvstack[serve]'")
        return
    except UserError as e:
        fail(str(e))
        return
    err.print(
        f"serving {lm.name} with {stack} at {parsed}, KV memory {memory / 2**20:.0f} MiB, on http://{host}:{port}/v1"
        + (" (API key required)" if api_key else ""),
        highlight=False,
    )
    engine.start()
    try:
        uvicorn.run(create_app(engine, api_key, max_tokens), host=host, port=port, log_level="warning")
    except OSError as e:  # the port is taken, say
        fail(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}")
    finally:
        engine.stop()
