"""The small things a server user trips on (issue 38 item 7): the API key printed by --help, empty
``content`` pieces on a thinking template, a cancel's finish reason, and /metrics' histograms
without duplicate ``_created`` lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from bmoe.server.app import _as_openai
from tests.test_server import GUARD_S, served  # noqa: F401 - the module's server
from tests.test_server_requests import post


@pytest.mark.pure
def test_serve_help_never_shows_the_api_key() -> None:
    env = {**os.environ, "BMOE_API_KEY": "sekrit-4242"}
    r = subprocess.run([sys.executable, "-m", "bmoe.cli", "serve", "--help"], capture_output=True, text=True,
                       env=env, timeout=GUARD_S)
    assert r.returncode == 0 and "--api-key" in r.stdout, r.stderr
    assert "sekrit-4242" not in r.stdout + r.stderr
    assert "--no-webui" in r.stdout and "--cors-origin" in r.stdout and "--no-prompt-reuse" in r.stdout


@pytest.mark.pure
def test_a_cancelled_finish_is_one_of_openais_and_an_empty_content_piece_is_dropped() -> None:
    def chunk(delta: dict, finish: str | None = None, lp: object = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    assert _as_openai(chunk({}, "cancelled"))["choices"][0]["finish_reason"] == "length"
    assert _as_openai({"choices": [{"text": "", "finish_reason": "cancelled"}]})["choices"][0]["finish_reason"] == "length"
    assert _as_openai(chunk({"content": ""})) is None
    kept = [chunk({"role": "assistant", "content": ""}), chunk({"content": "x"}), chunk({"content": ""}, "stop"),
            chunk({"content": ""}, lp={"content": [{"token": "<"}]}), {"choices": [], "usage": {}}]
    assert all(_as_openai(c) is c for c in kept)


def test_a_stream_on_a_thinking_reply_sends_no_empty_content_pieces(served) -> None:  # noqa: F811
    url, _ = served
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 30, "temperature": 0.9,
            "seed": 4, "stream": True, "grammar": 'root ::= "<think>" [a-z]{2,6} "</think>" [a-z]{1,4}',
            "chat_template_kwargs": {"enable_thinking": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=GUARD_S) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert any("reasoning_content" in d for d in deltas) and any(d.get("content") for d in deltas)
    assert {"content": ""} not in deltas[1:], deltas


def test_metrics_have_latency_histograms_and_no_created_lines(served) -> None:  # noqa: F811
    url, _ = served
    assert post(url, "/v1/completions", {"prompt": "Once", "max_tokens": 2}).status_code == 200
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 2, "stream": True},
                      timeout=GUARD_S) as r:
        list(r.iter_lines())
    text = httpx.get(f"{url}/metrics", timeout=GUARD_S).text
    assert "_created" not in text
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.endswith(tuple("0123456789")) and "_count" in line}
    for name in ("bmoe_request_seconds", "bmoe_first_token_seconds", "bmoe_prompt_eval_seconds"):
        assert counts.get(f"{name}_count", 0) >= 2, (name, counts)
        assert f'{name}_bucket{{le="+Inf"}}' in text


def test_serve_flags_no_prompt_reuse_no_webui_and_a_bad_cors_origin(tiny) -> None:  # noqa: ANN001
    from bmoe.synth.tiny import TinySpec

    model = str(tiny.path(TinySpec()))
    bad = subprocess.run([sys.executable, "-m", "bmoe.cli", "serve", "-m", model, "--cors-origin", "http://a/b"],
                         capture_output=True, text=True, timeout=GUARD_S)
    assert bad.returncode != 0 and "--cors-origin" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "serve", "-m", model, "--port", "0", "-c", "256",
                             "--no-prompt-reuse", "--no-webui", "--cors-origin", "*"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        assert "chat page" not in line, line
        url = line.split()[-1].removesuffix("/v1")
        body = {"prompt": "The same prompt twice", "max_tokens": 2}
        cached = [httpx.post(f"{url}/v1/completions", json=body, timeout=GUARD_S).json()
                  ["usage"]["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
        assert cached == [0, 0]
        assert httpx.get(f"{url}/", timeout=GUARD_S).status_code == 404
        pre = httpx.options(f"{url}/v1/models", timeout=GUARD_S,
                            headers={"Origin": "http://x.example", "Access-Control-Request-Method": "GET"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://x.example")
    finally:
        proc.terminate()
        err = proc.communicate(timeout=GUARD_S)[1]
    assert err.strip().splitlines()[-1] == "bmoe serve: stopped by SIGTERM", err


@pytest.mark.pure
def test_the_page_ships_as_package_data() -> None:
    """An installed wheel (not only this checkout) must carry the page, or / is a 500 there."""
    import tomllib
    from importlib import resources
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "server/webui.html" in pyproject["tool"]["setuptools"]["package-data"]["bmoe"]
    page = (resources.files("bmoe.server") / "webui.html").read_text()
    assert page.startswith("<!doctype html>") and "/v1/chat/completions" in page
