"""The OpenAI-compatible server: a real uvicorn server on 127.0.0.1 (a free port), driven by the
official ``openai`` client and by httpx for what a client library would not send."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.pipeline.hooks import Hooks
from bmoe.server.app import create_app
from bmoe.synth.tiny import TinySpec

CONFIG = RunConfig(mode="stream", n_ctx=512, cache_bytes=MiB)
GUARD_S = 120  # turns a hang into a failure; nothing is timed


@contextlib.contextmanager
def running(app) -> Iterator[str]:  # noqa: ANN001
    """Serve ``app`` with uvicorn in a thread on a free loopback port; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, loop="uvloop", log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(GUARD_S * 100):
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.01)
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(GUARD_S)
        sock.close()


@pytest.fixture(scope="module")
def served(tiny) -> Iterator[tuple[str, str]]:
    path = tiny.path(TinySpec())
    with Session.open(path, CONFIG) as session, running(create_app(session)) as url:
        yield url, session.model_name


def client(url: str, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=GUARD_S)


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_models_health_chat_and_completion(served) -> None:
    url, name = served
    c = client(url)
    assert [m.id for m in c.models.list().data] == [name]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    chat = c.chat.completions.create(model=name, messages=CHAT, max_tokens=8)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 0
    done = c.completions.create(model=name, prompt="Once upon a time", max_tokens=6)
    again = c.completions.create(model=name, prompt="Once upon a time", max_tokens=6)
    assert done.choices[0].text == again.choices[0].text, "greedy by default: the same answer"
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "the second prompt reuses the first's context"


def test_streaming_chat_equals_the_whole_answer(served) -> None:
    url, name = served
    c = client(url)
    kw = dict(model=name, messages=CHAT, max_tokens=12, temperature=0.8, seed=5)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_include_usage_ends_the_stream_with_a_usage_chunk_without_choices(served) -> None:
    """``stream_options`` was dropped: OpenAI's shape, a last chunk with ``choices: []`` and the
    usage, never came for the clients that wait for it."""
    url, name = served
    c = client(url)
    chat = list(c.chat.completions.create(model=name, messages=CHAT, max_tokens=5, stream=True,
                                          stream_options={"include_usage": True}))
    text = list(c.completions.create(model=name, prompt="Once", max_tokens=5, stream=True,
                                     stream_options={"include_usage": True}))
    for chunks in (chat, text):
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5, chunks[-1]
        assert chunks[-2].choices[0].finish_reason == "length"
    plain = list(c.chat.completions.create(model=name, messages=CHAT, max_tokens=5, stream=True))
    assert plain[-1].choices, "no extra chunk unless asked"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}},
                   timeout=GUARD_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_json_schema_response_format_and_logprobs(served) -> None:
    url, name = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client(url).chat.completions.create(
        model=name, messages=CHAT, max_tokens=40, temperature=1.0, seed=2, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)


def test_two_concurrent_clients_each_get_their_sequential_answer(served) -> None:
    url, name = served
    prompts = ["The river runs", "Seven small stones"]
    c = client(url)
    alone = [c.completions.create(model=name, prompt=p, max_tokens=10).choices[0].text for p in prompts]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = client(url).completions.create(model=name, prompt=prompts[i], max_tokens=10).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GUARD_S)
    assert [got[0], got[1]] == alone


def test_a_client_that_disconnects_mid_stream_then_a_fresh_request(served) -> None:
    url, name = served
    c = client(url)
    body = {"model": name, "prompt": "Far away", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=GUARD_S) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    # The server cancels the abandoned generation; the next request runs normally.
    fresh = c.completions.create(model=name, prompt="Far away", max_tokens=5)
    assert fresh.choices[0].finish_reason == "length" and fresh.usage.completion_tokens == 5
    metrics = httpx.get(f"{url}/metrics").text
    assert 'bmoe_requests_total{outcome="disconnected"}' in metrics


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b'{"model": "m"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n must be 1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": 42}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "context"),
    ("/v1/completions", b'{"prompt": "x", "stream": true, "max_tokens": 100000}', 400, "context"),
    ("/v1/completions", b'{"prompt": "x", "response_format": {"type": "yaml"}}', 400, "response_format"),
    ("/v1/nothing", b"{}", 404, ""),
])
def test_bad_requests_get_4xx_in_the_openai_error_shape(served, path: str, body: bytes, status: int, needle: str) -> None:
    url, _ = served
    before = _bad_requests(url)
    r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=GUARD_S)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "type" in err and "Traceback" not in r.text
    if path != "/v1/nothing":  # a completion request refused, wherever it was refused, is counted
        assert _bad_requests(url) == before + 1


def _bad_requests(url: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    return sum(s.value for s in families["bmoe_requests"].samples
               if s.name == "bmoe_requests_total" and s.labels.get("outcome") == "bad_request")


def test_long_prompt_and_big_body(served) -> None:
    url, _ = served
    long_prompt = "word " * 3000  # more tokens than the 512-token context
    r = httpx.post(f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 4}, timeout=GUARD_S)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}', timeout=GUARD_S)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_metrics_parse_as_prometheus_text(served) -> None:
    url, name = served
    client(url).completions.create(model=name, prompt="Count me", max_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    for want in ("bmoe_completion_tokens", "bmoe_prompt_tokens", "bmoe_prompt_tokens_reused", "bmoe_tokens_per_second",
                 "bmoe_cache_hit_percent", "bmoe_expert_bytes_read", "bmoe_stall_milliseconds", "bmoe_queue_depth"):
        assert want in families, want
    assert families["bmoe_completion_tokens"].samples[0].value >= 4
    assert families["bmoe_expert_bytes_read"].samples[0].value > 0
    # The hit rate from the counters is the gauge's: hits over routed (a "misses" counter that
    # counted reads, read-ahead included, gave another figure).
    value = {n: families[n].samples[0].value for n in ("bmoe_cache_hits", "bmoe_experts_routed", "bmoe_experts_read")}
    assert "bmoe_cache_misses" not in families and value["bmoe_experts_routed"] > 0
    assert families["bmoe_cache_hit_percent"].samples[0].value == pytest.approx(
        100 * value["bmoe_cache_hits"] / value["bmoe_experts_routed"])


def test_api_key_and_a_full_queue(tiny) -> None:
    path = tiny.path(TinySpec())
    release = threading.Event()
    entered = threading.Event()

    def before_read(_request) -> bool:  # noqa: ANN001
        if hold["on"]:
            entered.set()
            assert release.wait(GUARD_S)
        return True

    hold = {"on": False}
    with Session.open(path, CONFIG, hooks=Hooks(before_read=before_read)) as session, \
            running(create_app(session, api_key="sesame", max_waiting=0)) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        c = client(url, "sesame")
        assert c.models.list().data
        hold["on"] = True
        result = {}
        first = threading.Thread(target=lambda: result.setdefault(
            "r", c.completions.create(model="m", prompt="Hold the line", max_tokens=3)))
        first.start()
        assert entered.wait(GUARD_S)  # the first request holds the only turn, blocked in a read
        busy = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sesame"})
        hold["on"] = False
        release.set()
        first.join(GUARD_S)
    assert busy.status_code == 503 and busy.headers["retry-after"].isdigit()
    assert busy.json()["error"]["type"] == "server_busy"
    assert result["r"].usage.completion_tokens == 3


def test_bmoe_serve_command(tiny) -> None:
    path = tiny.path(TinySpec())
    proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "serve", "-m", str(path), "--port", "0",
                             "-c", "256", "--api-key", "k"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "bmoe serve:" in line and "http://127.0.0.1:" in line, line
        url = line.split()[-4] if "(API key" in line else line.split()[-1]
        base = url.removesuffix("/v1")
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/v1/models").status_code == 401
        r = client(base, "k").completions.create(model="m", prompt="Hi", max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait(GUARD_S)
    bad = subprocess.run([sys.executable, "-m", "bmoe.cli", "serve", "-m", str(path.parent / "missing.gguf")],
                         capture_output=True, text=True, timeout=GUARD_S)
    assert bad.returncode == 1 and bad.stderr.startswith("bmoe: error:") and len(bad.stderr.splitlines()) == 1


def test_a_chat_longer_than_the_context_is_a_400(served) -> None:
    url, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 3000}]},
                   timeout=GUARD_S)
    assert r.status_code == 400 and "does not fit the context" in r.json()["error"]["message"]


def test_reasoning_content_and_template_kwargs_over_http(served) -> None:
    url, name = served
    r = httpx.post(f"{url}/v1/chat/completions", timeout=GUARD_S, json={
        "messages": CHAT, "max_tokens": 30, "temperature": 0.9, "seed": 4,
        "grammar": 'root ::= "<think>" [a-z]{2,6} "</think>" [a-z]{1,4}',
        "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"].isalpha() and message["content"].isalpha()
    bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": "x"}, timeout=GUARD_S)
    assert bad.status_code == 400
