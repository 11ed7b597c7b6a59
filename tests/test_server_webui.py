"""The page at / (issue 38 item 3): served by the server itself from the package, calling only
routes that exist, /stats, --no-webui, CORS (a browser's preflight answered before the API key is
asked for), and a real headless Chromium that sends a message and sees the streamed reply and the
panel (skipped where Debian's ``chromium`` is not installed)."""

from __future__ import annotations

import base64
import contextlib
import html.parser
import json
import os
import re
import select
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bmoe.engine.session import Session
from bmoe.server.app import create_app
from bmoe.synth.tiny import TinySpec
from tests.test_server import CONFIG, GUARD_S, running

ORIGIN = "http://front.example:3000"


@pytest.fixture(scope="module")
def opened(tiny) -> Iterator[Session]:  # noqa: ANN001
    with Session.open(tiny.path(TinySpec()), CONFIG) as session:
        yield session


@contextlib.contextmanager
def serving(session: Session, **app_kw) -> Iterator[str]:
    with running(create_app(session, **app_kw)) as url:  # one session, one app at a time around it
        yield url


@pytest.fixture
def served(opened) -> Iterator[str]:  # noqa: ANN001
    with serving(opened, api_key="k", cors_origins=[ORIGIN]) as url:
        yield url


KEY = {"Authorization": "Bearer k"}


def test_the_page_is_served_whole_from_the_package_without_the_key(served) -> None:
    r = httpx.get(f"{served}/", timeout=GUARD_S)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.headers
    assert "<title>bmoe</title>" in r.text
    assert "://" not in re.sub(r"<!--.*?-->", "", r.text, flags=re.DOTALL), "nothing fetched from elsewhere (no CDN)"
    assert httpx.get(f"{served}/stats", timeout=GUARD_S).status_code == 401, "only the page is open"


def test_the_pages_script_calls_only_routes_that_exist(served) -> None:
    page = httpx.get(f"{served}/", timeout=GUARD_S).text
    called = set(re.findall(r"""fetch\(\s*["'](/[^"']*)["']""", page))
    assert called == {"/v1/chat/completions", "/stats"}, called
    assert "fetch(" not in re.sub(r"""fetch\(\s*["']/[^"']*["']""", "", page), "every fetch names its route"
    for path in called:
        r = httpx.get(f"{served}{path}", headers=KEY, timeout=GUARD_S)
        if r.status_code == 405:  # a POST route: sent what the page sends
            r = httpx.post(f"{served}{path}", headers=KEY, timeout=GUARD_S, json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3})
        assert r.status_code == 200, (path, r.text)
    ids = set(re.findall(r'\$\("([\w-]+)"\)', page))
    parser = _Ids()
    parser.feed(page)
    assert ids <= parser.ids, ids - parser.ids


class _Ids(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:  # noqa: ARG002
        self.ids.update(v for k, v in attrs if k == "id")


def test_stats_say_what_the_last_generation_did(served) -> None:
    before = httpx.get(f"{served}/stats", headers=KEY, timeout=GUARD_S).json()
    r = httpx.post(f"{served}/v1/completions", headers=KEY, timeout=GUARD_S,
                   json={"prompt": "Once upon a time", "max_tokens": 4})
    stats = httpx.get(f"{served}/stats", headers=KEY, timeout=GUARD_S).json()
    last = stats["last"]
    assert last["generated_tokens"] == r.json()["usage"]["completion_tokens"] == 4
    assert last["tok_per_s"] > 0 and last["mib_read_per_token"] is not None
    assert stats["tokens_generated"] == before["tokens_generated"] + 4
    assert stats["cache"]["budget_mib"] == 1.0 and stats["generating"] is False
    assert 0 <= stats["cache_hit_pct_life"] <= 100


def test_cors_preflight_is_answered_for_the_origins_named_only(served, opened) -> None:
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{served}/v1/chat/completions", headers=ask, timeout=GUARD_S)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN, (r.status_code, r.headers)
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{served}/v1/chat/completions", headers={**ask, "Origin": "http://evil.example"},
                          timeout=GUARD_S)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    models = httpx.get(f"{served}/v1/models", headers={**KEY, "Origin": ORIGIN}, timeout=GUARD_S)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ORIGIN
    with serving(opened, webui=False) as plain:  # no --cors-origin: no preflight answered; --no-webui: no page
        assert httpx.options(f"{plain}/v1/chat/completions", headers=ask, timeout=GUARD_S).status_code == 405
        page = httpx.get(f"{plain}/", timeout=GUARD_S)
        assert page.status_code == 404 and set(page.json()["error"]) == {"message", "type", "param", "code"}


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _DevTools:
    """Chromium driven over ``--remote-debugging-pipe`` (its DevTools protocol as NUL-ended JSON
    on descriptors 3 and 4): no websocket client or browser driver package needed."""

    def __init__(self, profile: Path) -> None:
        to_child, self._to = os.pipe()
        self._from, from_child = os.pipe()
        # bash puts the pipe ends on 3 and 4 (dash takes no fd past 9; no preexec_fn: threads run).
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_child} 4>&{from_child}', CHROMIUM, "--headless", "--no-sandbox",
             "--disable-gpu", "--disable-dev-shm-usage", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             "--window-size=1200,800", "about:blank"],
            pass_fds=(to_child, from_child), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buf, self._id, self.session = b"", 0, None

    def call(self, method: str, **params: object) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        while True:  # events (no id) and other answers are skipped
            while b"\0" not in self._buf:
                ready, _, _ = select.select([self._from], [], [], GUARD_S)
                assert ready, f"chromium did not answer {method}"
                part = os.read(self._from, 1 << 20)
                assert part, "chromium went away"
                self._buf += part
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply["result"]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def value(self, expression: str) -> object:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(OSError, AssertionError):
            self.call("Browser.close")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(GUARD_S)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to)
        os.close(self._from)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_a_headless_chromium_sends_a_message_and_sees_the_reply_and_the_panel(opened, tmp_path: Path) -> None:
    """The page in a real browser: ``/?q=`` sends a message at load; the streamed reply shows and
    the panel fills in with the generation's figures. Waits for states, not times; the screenshot
    is left in the test's folder (``webui.png``)."""
    browser = _DevTools(tmp_path / "profile")
    try:
        with serving(opened) as url:
            browser.open(f"{url}/?q=Name%20a%20colour.&max=8")
            text = "(() => { const d = document.querySelector('.msg.assistant'); return d ? d.textContent : ''; })()"
            for _ in range(GUARD_S * 10):
                panel = browser.value("document.getElementById('tokens').textContent")
                if re.fullmatch(r"\d+ / [1-9]\d*", str(panel)) and browser.value(text):
                    break
                threading.Event().wait(0.1)
            else:
                raise AssertionError("the panel never showed the generation")
            reply = browser.value(text)
            assert reply and "error:" not in reply, reply
            assert int(browser.value("document.getElementById('live-tokens').textContent")) >= 1
            assert browser.value("document.getElementById('budget').textContent") == "1 MiB"
            shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    finally:
        browser.close()
    (tmp_path / "webui.png").write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
