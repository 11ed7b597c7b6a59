"""``bmoe serve --parallel N``: concurrent clients decoded in the same steps, each answer its own,
a client gone leaving the others, and the step figures in /slots and /metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.server.app import create_app
from bmoe.synth.tiny import TinySpec
from tests.test_server import GUARD_S, client, running

PROMPTS = ["Routed experts stream from the disk.", "The cache keeps what is used most.",
           "Four clients wait in a queue.", "A short one."]
N = 12


def test_four_clients_share_steps_and_get_their_own_tokens(tiny) -> None:
    path = tiny.path(TinySpec())

    async def alone() -> list[list[int]]:
        async with await Session.open_async(path, RunConfig(mode="resident", n_ctx=1024, parallel=4)) as s:
            gens = await asyncio.gather(*(s.generate(p, N) for p in PROMPTS))
            return [g.text for g in gens]

    want = asyncio.run(alone())
    config = RunConfig(mode="stream", n_ctx=1024, cache_bytes=MiB, parallel=4)
    with Session.open(path, config) as session, running(create_app(session)) as url:
        c = client(url)

        def ask(prompt: str) -> str:
            r = c.completions.create(model="m", prompt=prompt, max_tokens=N, temperature=0)
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, PROMPTS))
        slots = httpx.get(f"{url}/slots", timeout=GUARD_S).json()
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    assert len(slots) == 4 and all(not s["is_processing"] for s in slots) and slots[0]["n_ctx"] == 256
    hist = {s.labels.get("le"): s.value for s in families["bmoe_step_batch_size"].samples
            if s.name.endswith("_bucket")}
    assert hist["+Inf"] > hist["1"], "no decode step held more than one sequence"
    assert families["bmoe_step_decode_tokens"].samples[0].value > 0
    # Arrival order over HTTP is not fixed, so the schedule may differ from the in-process run's;
    # on this fixture a sequence's tokens do not depend on its batch (docs/scheduler.md).
    assert sorted(texts) == sorted(want)


def _busy(url: str) -> int:
    return sum(s["is_processing"] for s in httpx.get(f"{url}/slots", timeout=GUARD_S).json())


def _wait(url: str, done) -> None:  # noqa: ANN001
    for _ in range(GUARD_S * 20):
        if done():
            return
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_leaves_the_others_running(tiny, stream: bool) -> None:
    """A client goes away while its generation runs (mid-stream, or a plain request whose socket
    closes): the other sequence runs to its end, and the gone one's slot comes back."""
    path = tiny.path(TinySpec())
    config = RunConfig(mode="resident", n_ctx=2048, parallel=2)
    with Session.open(path, config) as session, running(create_app(session)) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(lambda: httpx.post(f"{url}/v1/completions", timeout=GUARD_S, json={
                "prompt": PROMPTS[1], "max_tokens": 40}).json())
            body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 1000, "stream": stream}).encode()
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=GUARD_S) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                if stream:
                    sock.recv(1)  # its first bytes came: it generates
                else:
                    _wait(url, lambda: _busy(url) >= 1)
            done = other.result(GUARD_S)
        assert done["choices"][0]["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 40
        _wait(url, lambda: _busy(url) == 0)  # the gone client's slot comes back
        assert _busy(url) == 0
