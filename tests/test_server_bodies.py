"""Request bodies under a flood (issue 39, items 5, 6 and 10): parsed off the event loop, a bounded
number (and bytes) held at once with 503 past the bound, a client gone mid-body a quiet line, and
the small refusals (an empty prompt, a long model name echoed). Nothing here is timed: every wait
is for a state (a gauge, an event), bounded by a guard that only turns a hang into a failure."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from bmoe.engine.session import Session
from bmoe.server.app import create_app
from bmoe.synth.tiny import TinySpec
from tests.test_server import CONFIG, GUARD_S, running
from tests.test_server_requests import errors_logged, metric, post, until

SMALL = b'{"prompt": "Once upon a time", "max_tokens": 2}'


@contextlib.contextmanager
def serving(tiny, **app_kw) -> Iterator[str]:  # noqa: ANN001
    with Session.open(tiny.path(TinySpec()), CONFIG) as session, running(create_app(session, **app_kw)) as url:
        yield url


def begin(url: str, body: bytes, sent: int, path: str = "/v1/completions") -> socket.socket:
    """A POST whose headers announce ``body`` whole but of which only ``sent`` bytes are sent."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GUARD_S)
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body[:sent])
    return sock


def finish(sock: socket.socket, body: bytes, sent: int) -> int:
    """Send the rest of the body; the response's status."""
    sock.sendall(body[sent:])
    got = b""
    while b"\r\n" not in got:
        part = sock.recv(4096)
        assert part, "the server closed the connection without a response"
        got += part
    sock.close()
    return int(got.split(b" ", 2)[1])


def held(url: str) -> float:
    return metric(url, "bmoe_request_bodies_held")


def test_past_the_bound_on_bodies_held_at_once_a_request_is_a_503_in_the_openai_shape(tiny) -> None:
    with serving(tiny, max_bodies=2) as url:
        slow = [begin(url, SMALL, 10) for _ in range(2)]
        until(lambda: held(url) == 2)
        r = post(url, "/v1/completions", SMALL)
        assert r.status_code == 503, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert r.json()["error"]["type"] == "server_busy" and r.headers["retry-after"], r.text
        assert metric(url, "bmoe_requests", "busy") >= 1
        assert [finish(s, SMALL, 10) for s in slow] == [200, 200], "the held ones are answered"
        until(lambda: held(url) == 0)
        assert post(url, "/v1/completions", SMALL).status_code == 200, "a place is free again"


def test_past_the_bound_on_the_bytes_held_a_request_is_a_503_and_a_small_one_still_fits(tiny) -> None:
    big = b'{"prompt": "hi", "max_tokens": 2' + b" " * 900 + b"}"  # JSON's own spaces
    with serving(tiny, max_body=1000, max_held_bytes=len(big) + 100) as url:
        first = begin(url, big, 10)
        until(lambda: held(url) == 1)
        r = post(url, "/v1/completions", big)  # its declared length alone passes the bound
        assert r.status_code == 503 and "bytes" in r.json()["error"]["message"], r.text
        assert post(url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}').status_code == 200
        assert finish(first, big, 10) == 200
        until(lambda: held(url) == 0)
        assert post(url, "/v1/completions", big).status_code == 200


def test_bodies_are_parsed_off_the_event_loop(tiny, monkeypatch) -> None:  # noqa: ANN001
    """The loop answers /health while a body is being parsed: on the loop, /health waited for it."""
    import bmoe.server.app as app_module

    entered, release = threading.Event(), threading.Event()
    real = app_module._parse

    def blocked(*args):  # noqa: ANN002, ANN202
        entered.set()
        assert release.wait(GUARD_S)
        return real(*args)

    monkeypatch.setattr(app_module, "_parse", blocked)
    with serving(tiny) as url:
        done: list[httpx.Response] = []
        asker = threading.Thread(target=lambda: done.append(post(url, "/v1/completions", SMALL)))
        asker.start()
        try:
            assert entered.wait(GUARD_S)
            assert httpx.get(f"{url}/health", timeout=GUARD_S / 4).status_code == 200
            assert held(url) == 1 and not done
        finally:
            release.set()
            asker.join(GUARD_S)
        assert done[0].status_code == 200, done[0].text


def test_a_client_gone_mid_body_logs_no_traceback(tiny) -> None:
    with serving(tiny) as url, errors_logged() as seen:
        before = metric(url, "bmoe_requests", "disconnected")
        sock = begin(url, SMALL, 10)
        until(lambda: held(url) == 1)
        sock.close()
        until(lambda: held(url) == 0)
        assert post(url, "/v1/completions", SMALL).status_code == 200
        assert not seen, [rec.getMessage() for rec in seen]
        assert metric(url, "bmoe_requests", "disconnected") == before + 1


@pytest.mark.parametrize("prompt", ["", [""]])
def test_an_empty_prompt_is_a_400_as_the_cli_refuses_it(tiny, prompt) -> None:  # noqa: ANN001
    with serving(tiny) as url:
        r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "empty" in r.json()["error"]["message"]


def test_a_404_does_not_echo_a_long_model_name_whole(tiny) -> None:
    with serving(tiny) as url:
        r = httpx.get(f"{url}/v1/models/{'m' * 10_000}", timeout=GUARD_S)
        assert r.status_code == 404 and len(r.text) < 500, len(r.text)
        assert r.json()["error"]["code"] == "model_not_found" and "mmm..." in r.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    b'{"prompt": "hi", "user": "a\xed\xa0\x80b"}',  # a surrogate in raw UTF-8 (json.loads lets it through)
    '{"prompt": "hi", "user": "a\ud800b"}'.encode("utf-16", "surrogatepass"),  # json.loads reads UTF-16 too
    b'{"prompt": "hi", "user": "a\\uDBFFb"}',
])
def test_the_byte_scan_that_spares_the_tree_walk_misses_no_surrogate(tiny, body: bytes) -> None:
    """Large flat bodies skip the walk in Python (their bytes show nothing it could refuse): a
    surrogate however spelt must still be a 400 (in a field the engine never sees, here)."""
    with serving(tiny) as url:
        r = post(url, "/v1/completions", body)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_a_body_that_never_comes_whole_is_a_408_and_gives_its_place_back(tiny) -> None:
    """A client trickling bodies held every place (503 for all others) for as long as it liked."""
    with serving(tiny, max_bodies=1, body_deadline_s=0.5) as url:
        slow = begin(url, SMALL, 10)
        got = b""
        while b"\r\n" not in got:  # the server answers by itself: the rest never comes
            part = slow.recv(4096)
            assert part, "closed without a response"
            got += part
        slow.close()
        assert int(got.split(b" ", 2)[1]) == 408, got
        until(lambda: held(url) == 0)
        assert post(url, "/v1/completions", SMALL).status_code == 200
