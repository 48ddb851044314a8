"""The HTTP side: OpenAI's `/v1/completions` and `/v1/chat/completions` (streamed or not),
`/v1/models`, `/health` and Prometheus `/metrics`, over an `Engine`. Every refusal is one JSON
error in OpenAI's shape with a clear status: 400 bad input, 401 key, 404 model, 413 too large,
503 full (with Retry-After)."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from kvstack.cache.budget import Budget
from kvstack.errors import UserError
from kvstack.serve.engine import Engine, Event, Job, QueueFull, Sampling
from kvstack.serve.protocol import ChatRequest, CompletionRequest, Extras
from kvstack.stack import Stack

MAX_BODY = 8 * 2**20  # bytes of JSON per request


class Refused(Exception):
    """A request the server will not run: an HTTP status and one line saying why."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **headers: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def create_app(engine: Engine, api_key: str | None = None, max_tokens: int = 1024) -> FastAPI:
    """The server's routes over `engine`; `/v1/*` needs `Bearer api_key` when one is set;
    `max_tokens` caps what one request may generate."""
    app = FastAPI(title="kvstack", docs_url=None, redoc_url=None)
    registry = CollectorRegistry()
    registry.register(_Collector(engine))

    @app.exception_handler(Refused)
    async def refused(_: Request, e: Refused) -> JSONResponse:
        return _error(e.status, e.message, e.kind, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_line(e.errors()), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http(_: Request, e: HTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "invalid_request_error")

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Any) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            return _error(413, f"request body of {int(size)} bytes: send at most {MAX_BODY} bytes", "too_large")
        return await call_next(request)

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), api_key.encode()):
            raise Refused(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "authentication_error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.lm.name, "object": "model", "owned_by": "kvstack"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)], response_model=None)
    async def completions(body: CompletionRequest) -> Any:
        return await _serve(engine, body, "text_completion", max_tokens, default_tokens=16)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)], response_model=None)
    async def chat(body: ChatRequest) -> Any:
        body.max_tokens = body.max_completion_tokens or body.max_tokens
        return await _serve(engine, body, "chat.completion", max_tokens, default_tokens=max_tokens)

    return app


async def _serve(engine: Engine, body: Extras, kind: str, limit: int, default_tokens: int) -> Any:
    """Run one request on the engine; the whole answer, or a stream of server-sent events."""
    job = _job(engine, body, limit, default_tokens)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(event: Event) -> None:  # called on the engine's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
            job.cancelled.set()

    job.emit = emit
    try:
        engine.submit(job)
    except QueueFull as e:
        raise Refused(503, str(e), "server_full", **{"Retry-After": str(e.retry_after)}) from None
    head = {"id": f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"}
    head |= {"created": int(time.time()), "model": engine.lm.name}
    if body.stream:
        return StreamingResponse(_stream(job, events, head, kind), media_type="text/event-stream")
    text: list[str] = []
    try:
        while (event := await events.get()).finish is None:
            text.append(event.text)
    finally:
        job.cancelled.set()  # a client gone before the end frees its cache at the next step
    if event.finish == "refused":
        raise Refused(400, str(event.error))
    if event.finish == "error":
        raise Refused(500, f"the request failed: {event.error}", "server_error")
    answer = "".join(text)
    choice = {"index": 0, "finish_reason": event.finish}
    choice |= {"text": answer, "logprobs": None} if kind == "text_completion" else {}
    choice |= {"message": {"role": "assistant", "content": answer}} if kind != "text_completion" else {}
    return {**head, "object": kind, "choices": [choice], "usage": event.usage, "kv": event.kv}


async def _stream(job: Job, events: asyncio.Queue[Event], head: dict[str, Any], kind: str) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, one with the finish reason, usage and the
    cache's measurements, then `[DONE]`. A client that goes away cancels its request."""
    chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"

    def chunk(text: str | None, finish: str | None, **extra: Any) -> str:
        if kind == "text_completion":
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'object': chunk_kind, 'choices': [choice], **extra})}\n\n"

    try:
        if kind != "text_completion":
            yield f"data: {json.dumps({**head, 'object': chunk_kind, 'choices': [_role_delta()]})}\n\n"
        while (event := await events.get()).finish is None:
            yield chunk(event.text, None)
        if event.finish in ("error", "refused"):
            yield f"data: {json.dumps({'error': {'message': str(event.error), 'type': event.finish}})}\n\n"
        else:
            yield chunk(None, event.finish, usage=event.usage, kv=event.kv)
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def _role_delta() -> dict[str, Any]:
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


def _job(engine: Engine, body: Extras, limit: int, default_tokens: int) -> Job:
    """The engine's job for a request body, checked: every user error a 4xx with one line."""
    if body.model is not None and body.model != engine.lm.name:
        raise Refused(404, f"model '{body.model}' is not served here: use '{engine.lm.name}'", "model_not_found")
    if body.n != 1:
        raise Refused(400, f"n={body.n}: this server returns one choice per request; send n=1")
    new_tokens = body.max_tokens or min(default_tokens, limit)
    if new_tokens > limit:
        raise Refused(400, f"max_tokens {new_tokens} is above this server's limit of {limit}: ask for fewer")
    try:
        stack = Stack.parse(body.kv_method) if body.kv_method is not None else engine.stack
        budget = Budget.parse(body.kv_budget) if body.kv_budget is not None else engine.budget
        stack.check_budget(budget)
        prompt = body.prompt_ids(engine.lm)  # type: ignore[attr-defined]
        job = Job(
            context=prompt.context,
            question=prompt.question,
            stack=stack,
            budget=budget,
            max_tokens=new_tokens,
            emit=lambda _: None,
            sampling=Sampling(body.temperature, body.top_p, body.seed),
            stop=body.stops(),
            document=body.kv_context,
        )
        engine.check(job)
    except UserError as e:
        status = 413 if "--kv-memory" in str(e) else 400
        raise Refused(status, str(e)) from None
    return job


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def _validation_line(errors: Any) -> str:
    """The first of pydantic's errors as one line: malformed JSON, or the field and what is wrong."""
    first = list(errors)[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return f"{where}: {first.get('msg', 'invalid')}"


class _Collector:
    """Prometheus metrics read off the engine at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        s = self.engine.snapshot()
        gauges = {
            "kv_memory_bytes": "the KV bytes the server may hold (--kv-memory)",
            "kv_bytes_held": "KV bytes the running requests' caches hold, read off their tensors",
            "kv_bytes_reserved": "KV bytes admission counts for the running requests",
            "kv_bytes_held_peak": "the most KV bytes held at once since the start",
            "requests_running": "requests holding a cache now",
            "requests_running_peak": "the most requests held at once since the start",
            "requests_waiting": "requests queued for memory",
            "tokens_per_second": "tokens generated per second over the last 10 s",
        }
        for name, doc in gauges.items():
            yield GaugeMetricFamily(f"kvstack_{name}", doc, value=s[name])
        finished = CounterMetricFamily("kvstack_requests", "requests ended, by how", labels=["outcome"])
        for outcome, n in sorted(s["finished"].items()):
            finished.add_metric([outcome], n)
        yield finished
        for name, doc in (
            ("prompt_tokens", "prompt tokens prefilled"),
            ("generated_tokens", "tokens generated"),
            ("store_hits", "documents loaded from the prefix store"),
            ("store_misses", "documents compressed and stored"),
        ):
            yield CounterMetricFamily(f"kvstack_{name}", doc, value=s[name])
