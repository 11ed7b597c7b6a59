"""The page at / (issue 38 item 3): served by the server itself from the package, calling only
routes that exist, /stats, --no-webui, CORS (a browser's preflight answered before the API key is
asked for), and a real headless Chromium that sends a message and sees the streamed reply and the
panel (skipped where Debian's ``chromium`` is not installed)."""

from __future__ import annotations

import contextlib
import html.parser
import re
import shutil
import subprocess
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
    assert "://" not in re.sub(r"<!--.*?-->", "", r.text, flags=re.S), "nothing fetched from elsewhere (no CDN)"
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


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_a_headless_chromium_sends_a_message_and_sees_the_reply_and_the_panel(opened, tmp_path: Path) -> None:
    """The page in a real browser: ``/?q=`` sends a message at load; the DOM after the reply holds
    the streamed text and the panel's figures. The screenshot is left in the test's folder."""
    with serving(opened) as url:
        base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,800", "--virtual-time-budget=20000"]
        page = f"{url}/?q=Name%20a%20colour."
        dom = subprocess.run([*base, "--dump-dom", page], capture_output=True, text=True, timeout=GUARD_S)
        shot = tmp_path / "webui.png"
        subprocess.run([*base, f"--screenshot={shot}", page], capture_output=True, timeout=GUARD_S)
    assert dom.returncode == 0, dom.stderr[-2000:]
    reply = re.search(r'class="msg assistant"><div class="think">(.*?)</div><div>(.*?)</div>', dom.stdout, re.S)
    assert reply is not None and (reply.group(1) or reply.group(2)).strip(), dom.stdout[-3000:]
    assert "error:" not in reply.group(2)
    assert re.search(r'id="live-tokens">[1-9]', dom.stdout), "the live count moved"
    assert re.search(r'id="tokens">\d+ / [1-9]', dom.stdout), "the panel shows the last generation"
    assert shot.exists() and shot.stat().st_size > 10_000
