"""Load runs against a real `kvstack serve` on loopback, one server process per configuration.

`load`: N concurrent requests, each a different 2k-token slice of essays, at each (method, budget)
with one --kv-memory: how many the server held at once (its /metrics peak), held bytes, every
request's status (none may be lost), p50/p95 latency and throughput.
`reuse`: ten questions about one 2k document sent as `kv_context` (prefix store), one after the
other: the first compresses, the next nine load; their times to the first token against a plain
prefill's (a full-cache request of the same document with max_tokens=1).

Run from the repository root, e.g.
    python scripts/serve_load.py load --configs "full:1.0,auto:0.125" --kv-memory 400MB --requests 32
    python scripts/serve_load.py reuse --method kvzip --budget 0.125
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx


@contextmanager
def server(args: argparse.Namespace, method: str, budget: str, store: str) -> Iterator[str]:
    """A `kvstack serve` process on a free port; its base URL once /health answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "kvstack.cli", "serve", "--model", args.model, "--method", method]
    command += ["--budget", budget, "--kv-memory", args.kv_memory, "--port", str(port), "--store", store]
    command += ["--max-waiting", str(args.requests + 1)]
    proc = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def metrics(url: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvstack_") and " " in line:
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def slices(model: str, n: int, tokens: int) -> list[str]:
    """`n` different texts of about `tokens` tokens each, cut from the shipped essays."""
    from kvstack.bench.data import paul_graham_essays
    from kvstack.models import load

    tok = load(model).tokenizer
    ids = tok.encode("\n\n".join(paul_graham_essays()), add_special_tokens=False)
    step = max(1, (len(ids) - tokens) // max(1, n))
    return [
        tok.decode(ids[i * step : i * step + tokens]) + "\n\nIn one sentence, the text above says that"
        for i in range(n)
    ]


def load_run(args: argparse.Namespace) -> None:
    prompts = slices(args.model, args.requests, args.tokens)
    for config in args.configs.split(","):
        method, budget = config.rsplit(":", 1)
        with tempfile.TemporaryDirectory() as store, server(args, method, budget, store) as url:
            warm = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 2}, timeout=900)
            warm.raise_for_status()  # a first compression plans `auto` (calibration read from disk)

            def send(prompt: str) -> dict:
                started = time.perf_counter()
                r = httpx.post(
                    f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": args.max_tokens}, timeout=3600
                )
                row = {"status": r.status_code, "seconds": time.perf_counter() - started}
                if r.status_code == 200:
                    body = r.json()
                    row |= {"tokens": body["usage"]["completion_tokens"], "kv_bytes": body["kv"]["kv_bytes"]}
                    row |= {"ttft_s": body["kv"]["time_to_first_token_s"], "kv_ratio": body["kv"]["kv_ratio"]}
                return row

            started = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                rows = list(pool.map(send, prompts))
            wall = time.perf_counter() - started
            seen = metrics(url)
        ok = [r for r in rows if r["status"] == 200]
        latency = sorted(r["seconds"] for r in ok)
        summary = {
            "method": method,
            "budget": budget,
            "kv_memory": args.kv_memory,
            "requests": len(rows),
            "answered": len(ok),
            "statuses": sorted({r["status"] for r in rows}),
            "held_at_once": int(seen["kvstack_requests_running_peak"]),
            "peak_kv_mib": seen["kvstack_kv_bytes_held_peak"] / 2**20,
            "kv_mib_per_request": statistics.mean(r["kv_bytes"] for r in ok) / 2**20 if ok else None,
            "kv_ratio": statistics.mean(r["kv_ratio"] for r in ok) if ok else None,
            "p50_s": latency[len(latency) // 2] if ok else None,
            "p95_s": latency[min(len(latency) - 1, int(0.95 * len(latency)))] if ok else None,
            "ttft_p50_s": sorted(r["ttft_s"] for r in ok)[len(ok) // 2] if ok else None,
            "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
            "wall_s": wall,
        }
        print(json.dumps(summary), flush=True)


def reuse_run(args: argparse.Namespace) -> None:
    import torch

    from kvstack.bench.runner import _essays
    from kvstack.bench.tasks.ruler import niah
    from kvstack.models import load

    torch.manual_seed(0)
    tok = load(args.model).tokenizer
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    sample = niah("reuse", 0, args.tokens, count, 0, "prose", _essays(), keys=10, queries=10)
    with tempfile.TemporaryDirectory() as store, server(args, args.method, args.budget, store) as url:
        post = lambda body: httpx.post(f"{url}/v1/completions", json=body, timeout=3600).json()  # noqa: E731
        post({"prompt": "warm up", "max_tokens": 2, "kv_method": "full", "kv_budget": 1.0})
        plain = [
            post({"prompt": sample.context, "max_tokens": 1, "kv_method": "full", "kv_budget": 1.0})["kv"]
            for _ in range(2)
        ]
        prefill = min(p["time_to_first_token_s"] for p in plain)
        for i, q in enumerate(sample.questions):
            body = post(
                {"prompt": q.question, "max_tokens": q.max_new_tokens, "kv_context": sample.context}
                | {"kv_answer_prefix": q.answer_prefix}
            )
            text = body["choices"][0]["text"]
            row = {"question": i, "store": body["kv"]["prefix_store"], "ttft_s": body["kv"]["time_to_first_token_s"]}
            row |= {
                "vs_prefill": body["kv"]["time_to_first_token_s"] / prefill,
                "found": all(a in text for a in q.answers),
                "answer": text.strip()[:40],
                "expected": list(q.answers),
            }
            print(json.dumps(row), flush=True)
    print(json.dumps({"plain_prefill_s": prefill, "method": args.method, "budget": args.budget}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["load", "reuse"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", default="full:1.0,auto:0.125")
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--budget", default="0.125")
    parser.add_argument("--kv-memory", default="400MB")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    (load_run if args.mode == "load" else reuse_run)(args)


if __name__ == "__main__":
    main()
