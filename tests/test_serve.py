"""`kvstack serve` on loopback, driven by the `openai` client: answers equal the library's,
streams equal whole answers, admission holds the KV bytes under --kv-memory, every bad request
is one clear error, and the server keeps serving after each (a client killed mid-stream too)."""

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import openai
import pytest
import uvicorn

from kvstack import Budget, Stack, answer, load
from kvstack.reuse.store import PrefixStore
from kvstack.serve.app import create_app
from kvstack.serve.engine import Engine

KEY = "test-key"
SPEC = "snapkv(window_size=4, every=4)"
DOC = "The key is 4711. Blue whales sing at dawn. " * 4


@pytest.fixture(scope="module")
def lm(tiny_folder):
    return load(str(tiny_folder))


@contextmanager
def running(lm, tmp_path, kv_memory=2**30, max_waiting=64, max_tokens=64):
    """A real uvicorn server on a free loopback port, its engine, and an `openai` client for it."""
    engine = Engine(lm, Stack.parse(SPEC), Budget.parse(0.5), kv_memory, PrefixStore(tmp_path, "100MB"), max_waiting)
    engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, KEY, max_tokens), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = sock.getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        yield engine, client, port
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()


def raw(port, method, path, body=None, key=KEY):
    """(status, parsed JSON or text, headers) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request(
        method, path, body=body if isinstance(body, (str, bytes, type(None))) else json.dumps(body), headers=headers
    )
    response = conn.getresponse()
    data = response.read().decode()
    try:
        data = json.loads(data)
    except json.JSONDecodeError:
        pass
    return response.status, data, dict(response.getheaders())


def test_completions_and_chat_answer_like_the_library(lm, tmp_path):
    expected = answer(lm, [DOC], ["key?"], SPEC, 0.5, query_agnostic=True, max_new_tokens=8)
    with running(lm, tmp_path) as (_, client, _port):
        got = client.completions.create(model=lm.name, prompt="key?", max_tokens=8, extra_body={"kv_context": DOC})
        assert got.choices[0].text.strip() == expected.answers[0]
        assert got.usage.completion_tokens == len(expected.new_tokens[0]) or got.choices[0].finish_reason == "stop"
        assert got.model_extra["kv"]["kv_bytes"] == expected.kv_bytes
        chat = client.chat.completions.create(
            model=lm.name, messages=[{"role": "user", "content": "key?"}], max_tokens=8, extra_body={"kv_context": DOC}
        )
        assert chat.choices[0].message.content.strip() == expected.answers[0]
        assert chat.model_extra["kv"]["prefix_store"] == "hit"  # the second request loads the document


def test_a_stream_equals_the_whole_answer(lm, tmp_path):
    with running(lm, tmp_path) as (_, client, _port):
        kwargs = {"model": lm.name, "prompt": DOC, "max_tokens": 12, "extra_body": {"kv_budget": 0.25}}
        whole = client.completions.create(**kwargs).choices[0].text
        pieces = list(client.completions.create(stream=True, **kwargs))
        assert "".join(p.choices[0].text for p in pieces) == whole
        assert pieces[-1].choices[0].finish_reason in ("stop", "length")
        chat = [{"role": "user", "content": DOC}]
        whole = client.chat.completions.create(model=lm.name, messages=chat, max_tokens=10).choices[0].message.content
        streamed = client.chat.completions.create(model=lm.name, messages=chat, max_tokens=10, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole


def test_admission_keeps_the_bytes_under_the_memory_and_answers_everyone(lm, tmp_path):
    with running(lm, tmp_path) as (engine, _client, _port):
        need = engine._first_bytes(probe_job(engine, lm))
    with running(lm, tmp_path, kv_memory=2 * need + need // 2) as (engine, client, port):
        answers = []

        def ask():
            answers.append(client.completions.create(model=lm.name, prompt=DOC, max_tokens=20).choices[0].text)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(answers) == 6 and len(set(answers)) == 1  # greedy: one prompt, one answer
        snap = engine.snapshot()
        # a prompt reserves its full cache while it goes in, then what its compressed cache will hold
        assert 2 <= snap["requests_running_peak"] < 6 and engine.ledger.peak_reserved <= engine.ledger.capacity
        assert 0 < snap["kv_bytes_held_peak"] <= engine.ledger.capacity
        assert snap["requests_running"] == 0 and snap["kv_bytes_reserved"] == 0
        status, text, _ = raw(port, "GET", "/metrics")
        assert status == 200 and f"kvstack_requests_running_peak {snap['requests_running_peak']:.1f}" in text
        assert 'kvstack_requests_total{outcome="length"}' in text or 'kvstack_requests_total{outcome="stop"}' in text


def probe_job(engine, lm):
    from kvstack.serve.engine import Job

    ids = lm.tokenizer.encode(DOC, add_special_tokens=False)
    return Job(ids, [], engine.stack, engine.budget, 20, emit=lambda _: None)


def test_a_full_queue_is_a_503_with_retry_after(lm, tmp_path):
    with running(lm, tmp_path) as (engine, _client, _port):
        need = engine._first_bytes(probe_job(engine, lm))
    with running(lm, tmp_path, kv_memory=need, max_waiting=0) as (engine, client, port):
        engine.ledger.reserve(-1, need)  # memory taken: nothing more is admitted, and nothing may wait
        status, body, headers = raw(port, "POST", "/v1/completions", {"prompt": DOC, "max_tokens": 4})
        assert status == 503 and int(headers["retry-after"]) >= 1 and "retry" in body["error"]["message"]
        engine.ledger.release(-1)
        assert client.completions.create(model=lm.name, prompt=DOC, max_tokens=4).choices[0].text is not None


@pytest.mark.parametrize(
    "body, status, words",
    [
        ('{"prompt": "hi", "max_tokens": ', 400, "malformed JSON"),
        ({"max_tokens": 4}, 400, "prompt: Field required"),
        ({"prompt": "hi", "kv_method": "snapkvv"}, 400, "snapkv"),
        ({"prompt": "hi", "kv_budget": 1.5}, 400, "out of range"),
        ({"prompt": "hi", "max_tokens": 100000}, 400, "limit of 64"),
        ({"prompt": "x" * 5000, "max_tokens": 4}, 400, "maximum"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "use 'tiny-llama"),
        ({"prompt": "hi", "n": 3}, 400, "n=1"),
    ],
)
def test_bad_requests_are_one_line_errors_and_the_server_goes_on(lm, tmp_path, body, status, words):
    with running(lm, tmp_path) as (_, client, port):
        got, data, _ = raw(port, "POST", "/v1/completions", body)
        assert got == status and words in data["error"]["message"] and "\n" not in data["error"]["message"]
        assert client.completions.create(model=lm.name, prompt="hi", max_tokens=2).choices


def test_a_request_larger_than_the_memory_is_a_413(lm, tmp_path):
    with running(lm, tmp_path, kv_memory=1000) as (_, _client, port):
        got, data, _ = raw(port, "POST", "/v1/completions", {"prompt": DOC, "max_tokens": 4})
        assert got == 413 and "--kv-memory" in data["error"]["message"]


def test_the_api_key_is_required(lm, tmp_path):
    with running(lm, tmp_path) as (_, _client, port):
        for key in (None, "wrong"):
            got, data, _ = raw(port, "POST", "/v1/completions", {"prompt": "hi"}, key=key)
            assert got == 401 and "API key" in data["error"]["message"]
        assert raw(port, "GET", "/v1/models", key="wrong")[0] == 401
        assert raw(port, "GET", "/health", key=None)[0] == 200


def test_a_client_killed_mid_stream_frees_its_cache(lm, tmp_path):
    with running(lm, tmp_path, max_tokens=1800) as (engine, client, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = json.dumps({"prompt": DOC, "max_tokens": 1800, "stream": True})
        conn.request(
            "POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200 and response.read(6) == b"data: "
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.time() + 30
        while engine.snapshot()["requests_running"] and time.time() < deadline:
            time.sleep(0.05)
        snap = engine.snapshot()
        assert snap["requests_running"] == 0 and snap["kv_bytes_held"] == 0
        assert snap["finished"].get("cancelled") == 1
        assert client.completions.create(model=lm.name, prompt="hi", max_tokens=2).choices


def test_the_command_serves_and_refuses_bad_options(tiny_folder, tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "kvstack.cli", "serve", "--model", str(tiny_folder), "--kv-memory", "0.5"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--kv-memory" in bad.stderr and "Traceback" not in bad.stderr
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = ["--model", str(tiny_folder), "--method", SPEC, "--budget", "0.5", "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstack.cli", "serve", *args, "--store", str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if raw(port, "GET", "/health", key=None)[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        got, data, _ = raw(port, "POST", "/v1/completions", {"prompt": DOC, "max_tokens": 3}, key=None)
        assert got == 200 and data["kv"]["method"] == str(Stack.parse(SPEC)) and data["usage"]["prompt_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_budget_the_method_refuses_on_this_prompt_is_a_400(lm, tmp_path):
    with running(lm, tmp_path) as (engine, client, port):
        body = {
            "prompt": "short",
            "max_tokens": 2,
            "kv_method": "kivi(bits=2, residual=32, group=16)",
            "kv_budget": 0.125,
        }
        got, data, _ = raw(port, "POST", "/v1/completions", body)
        assert got == 400 and "residual" in data["error"]["message"]
        assert engine.snapshot()["finished"] == {"refused": 1}  # found by the cache while compressing
        assert client.completions.create(model=lm.name, prompt="hi", max_tokens=2).choices


def test_sampling_is_seeded_and_top_p_keeps_the_head_of_the_distribution(lm, tmp_path):
    with running(lm, tmp_path) as (_, client, _port):

        def text(**kw):
            return client.completions.create(model=lm.name, prompt=DOC, max_tokens=12, **kw).choices[0].text

        greedy = text()
        assert text(temperature=1.5, seed=3) == text(temperature=1.5, seed=3)
        assert any(text(temperature=1.5, seed=s) != greedy for s in range(3))  # it does sample
        assert text(temperature=1.5, top_p=1e-6, seed=4) == greedy  # only the most likely token is left
